"""The decode plan's rules that depend on the shape or the GPU, not only on the format: split counts, the int4
ring, the register caps' exceptions. The per-format choices are data (tuned/*.json, `tuned_file.tuned_for_device`);
`plan.decode_plan` combines both. Each rule names the measurements that decided it (docs/kernels.md).
"""

from __future__ import annotations

from . import codes, decode_gluon
from .formats import KernelFormat
from .split_k import MIN_TOKENS_PER_SPLIT, choose_num_splits, split_tokens

# why: one-warp programs need ~1024 of them to keep the memory busy, and few (sequence, KV head) pairs cannot make
# them within the split cap; measured: benchmarks/results/kernel_variants.jsonl (rule=ONE_WARP_MAX_SPLITS)
ONE_WARP_PROGRAMS = 1024
ONE_WARP_MAX_SPLITS = 128

GLUON_STAGES = 2  # the int4 ring's stages, one tile a step
# why: the ring pays where splits are long; with one KV head only from 2048 tokens; measured:
# benchmarks/results/kernel_variants.jsonl (rule=gluon_stages_for)
RING_MIN_TOKENS = 1024
RING_MIN_TOKENS_ONE_HEAD = 2048
RING_FEW_PROGRAMS = 512  # the ring for few programs makes at least this many (`_few_splits`) ...
RING_MAX_SPLITS = 512  # ... with at most this many splits (the split rule's own limit is decode_gluon.MAX_SPLITS)
GLUON_PAIR_STAGES = 4  # a ring with tiles two a step: two stages read while two fill
GROUP_RING_STAGES = 2  # the group-scale formats' TMA ring (`gluon_group_ring`)
# why: one sequence's 1024-token splits through the ring beat the registers at 1024 programs (Llama-3-8B 1 x 131072,
# 7.8 programs an SM of the H200's 132: asym 0.0492 against 0.0524 ms); the ONE_WARP_PROGRAMS threshold sent the
# legacy step's table at 130000 tokens (1016 programs) to the registers; measured:
# benchmarks/results/kernel_variants.jsonl (rule=_long_splits), benchmarks/results/step_profile.jsonl (kind=plan)
ONE_SEQUENCE_PROGRAMS_PER_SM = 7

# why: among split counts > 1 the fewest within 5% of the best by the wave model (16 splits beat 15 at 16 x 32768);
# measured: benchmarks/results/kernel_variants.jsonl (rule=GLUON_SPLIT_TOLERANCE)
GLUON_SPLIT_TOLERANCE = 0.05

# why: fp8 per-token fits 128 registers for GQA groups of 2-7 only (ptxas spills at 1 and 8, uncapped runs faster
# there); measured: benchmarks/results/kernel_variants.jsonl (rule=FP8_TOKEN_CAP_GROUPS)
FP8_TOKEN_CAP_GROUPS = range(2, 8)


def one_warp_too_few(pairs: int, max_tokens: int) -> bool:
    """Whether one-warp programs would be too few to fill the GPU: pairs x the split cap < ONE_WARP_PROGRAMS."""
    splits = min(ONE_WARP_MAX_SPLITS, -(-max_tokens // MIN_TOKENS_PER_SPLIT))
    return pairs * splits < ONE_WARP_PROGRAMS


def gluon_for_few_programs(kf: KernelFormat) -> bool:
    """Whether the Gluon kernel still serves where one-warp programs are too few (`one_warp_too_few`).
    why: the static 8-bit formats' Triton 4-warp tile beats Gluon there, per-token formats and int4's ring do not;
    measured: benchmarks/results/kernel_variants.jsonl (rule=tuned_for)"""
    return kf.scale_mode == codes.PER_TOKEN or kf.kind == codes.INT4


def gluon_pairs_for(kf: KernelFormat, tma: bool) -> bool:
    """Whether the int4 ring takes its tiles two a step (`gluon_attend._attend_pair`).
    why: the per-token formats' per-tile bookkeeping is largest; per-head int4 gains only where the TMA unit fills the
    ring; measured: benchmarks/results/kernel_variants.jsonl (rule=gluon_pairs_for)"""
    return kf.kind == codes.INT4 and (kf.scale_mode == codes.PER_TOKEN or tma)


def gluon_tma_for(kf: KernelFormat, capability: int) -> bool:
    """Whether the TMA unit fills the int4 ring (K / V words and per-token scales) instead of cp.async from every lane.
    why: faster on sm_90 at every measured shape; Ampere has no TMA; measured:
    benchmarks/results/kernel_variants.jsonl (rule=gluon_tma_for)"""
    return kf.kind == codes.INT4 and capability >= 9


def gluon_group_ring(kf: KernelFormat, capability: int) -> bool:
    """Whether the Gluon kernel's group-scale tiles (`gluon_groups.py`) go through the TMA ring of GROUP_RING_STAGES
    (int4 on sm_90; elsewhere, and for int8, they load into registers a step ahead).
    why: at Llama-3-8B 16 x 32768 on an H100 the ring of 2 stages took INT4 group 32 / 64 to 2.90x / 3.24x cuDNN BF16
    against 2.63x / 2.74x from registers (3, 4 and 6 stages: slower); measured:
    benchmarks/results/kernels_group_scales_variants.jsonl"""
    return kf.groups > 1 and kf.kind == codes.INT4 and capability >= 9


def gluon_stages_for(kf: KernelFormat, tokens_per_split: int, kv_heads: int) -> int:
    """Stages of the Gluon kernel's shared-memory ring (0: tiles loaded into registers a step ahead): int4 with
    splits of >= RING_MIN_TOKENS (RING_MIN_TOKENS_ONE_HEAD where a page holds one KV head)."""
    least = RING_MIN_TOKENS_ONE_HEAD if kv_heads == 1 else RING_MIN_TOKENS
    return GLUON_STAGES if kf.kind == codes.INT4 and tokens_per_split >= least else 0


def gluon_registers(kf: KernelFormat, registers: int, ring_registers: int, ring: bool, group: int) -> int | None:
    """The Gluon kernel's register cap (None: uncapped) from the format's tuned caps (`registers`, and
    `ring_registers` through the ring; 0: none), except fp8 per-token at the groups where the cap spills."""
    if kf.kind == codes.FLOAT and kf.scale_mode == codes.PER_TOKEN and group not in FP8_TOKEN_CAP_GROUPS:
        return None
    return (ring_registers if ring else registers) or None


def programs_per_sm(registers: int | None) -> int:
    """One-warp programs an H100/H200 SM holds at `registers` per thread (None: uncapped, 12). A warp's registers come
    from one of the SM's 4 sub-partitions (16k registers each), allocated 8 per thread at a time, so every cap from
    104 to 128 holds 16 and 96 holds 20; an SM runs at most 32 programs."""
    if not registers:
        return 12
    per_warp = 32 * -(-registers // 8) * 8
    return min(32, 4 * (16384 // per_warp))


def gluon_splits(batch: int, kv_heads: int, max_tokens: int, tile: int, sms: int, registers: int | None) -> int:
    """The split rule's count for one-warp Gluon programs of `tile` tokens a step under a cap of `registers` (the
    programs an SM holds, `programs_per_sm`)."""
    return choose_num_splits(batch, kv_heads, max_tokens, tile, sms, programs_per_sm(registers),
                             decode_gluon.MIN_TOKENS_PER_SPLIT, decode_gluon.MAX_SPLITS,
                             refine_tolerance=GLUON_SPLIT_TOLERANCE)


def gluon_plan(kf: KernelFormat, batch: int, kv_heads: int, max_tokens: int, sms: int, group: int, tma: bool,
               registers: int, ring_registers: int) -> tuple[int | None, int, int, bool]:
    """The Gluon kernel's (register cap, split count, ring stages, tiles two a step). int4 is planned for the ring
    first (its register cap sets the programs per SM the split rule counts on); where the split rule's splits are too
    short for the ring: the ring with tiles two a step all the same if they make <= ONE_WARP_PROGRAMS programs
    (`_few_splits`), else with splits of RING_MIN_TOKENS if those still make ONE_WARP_PROGRAMS (`_long_splits`), else
    the registers."""

    def plan(ring: bool, splits: int | None = None, pairs: bool | None = None,
             short: bool = False) -> tuple[int | None, int, int, bool]:  # short: the ring for splits of any length
        two = ring and (gluon_pairs_for(kf, tma) if pairs is None else pairs)
        tile = decode_gluon.TILE * (2 if two else 1)
        cap = gluon_registers(kf, registers, ring_registers, ring, group)
        if splits is None:
            splits = gluon_splits(batch, kv_heads, max_tokens, tile, sms, cap)
        stages = 0 if not ring else GLUON_STAGES if short else gluon_stages_for(
            kf, split_tokens(max_tokens, splits, tile), kv_heads)
        stages = max(stages, GLUON_PAIR_STAGES) if two and stages else stages
        return cap, splits, stages, two and stages >= GLUON_PAIR_STAGES

    if kf.kind == codes.INT4:
        ring_plan = plan(True)
        if ring_plan[2]:
            return ring_plan
        # few programs: the ring of tiles two a step at the split rule's count; else, with more than one KV head,
        # splits of RING_MIN_TOKENS
        few = batch * kv_heads * ring_plan[1] <= ONE_WARP_PROGRAMS
        splits = _few_splits(batch * kv_heads, max_tokens, ring_plan[1]) if few else _long_splits(
            batch, kv_heads, max_tokens, sms)
        if few or splits:
            return plan(True, splits, True, short=few)
    return plan(False)


def _few_splits(pairs: int, max_tokens: int, splits: int) -> int:
    """The split rule's count for the ring of few programs, raised to make RING_FEW_PROGRAMS programs where splits of
    MIN_TOKENS_PER_SPLIT allow, up to RING_MAX_SPLITS.
    why: one sequence at Llama-3-70B TP8 ran fastest at 512 splits of 256 tokens, two sequences at the rule's count;
    measured: benchmarks/results/kernel_variants.jsonl (rule=_few_splits)"""
    want = -(-RING_FEW_PROGRAMS // pairs)
    return max(splits, min(want, max_tokens // decode_gluon.MIN_TOKENS_PER_SPLIT, RING_MAX_SPLITS))


def _long_splits(batch: int, kv_heads: int, max_tokens: int, sms: int) -> int | None:
    """Splits of RING_MIN_TOKENS for int4 where the split rule's are too short for the ring, if that leaves >=
    ONE_WARP_PROGRAMS (sequence, KV head, split) programs -- for one sequence, >= ONE_SEQUENCE_PROGRAMS_PER_SM on
    every SM; not with one KV head.
    why: Llama-3-8B 1 x 131072 ran faster through the ring at 128 splits than from registers at 244; with one KV head
    the registers won; measured: benchmarks/results/kernel_variants.jsonl (rule=_long_splits)"""
    splits = max_tokens // RING_MIN_TOKENS
    programs = batch * kv_heads * splits
    enough = programs >= (ONE_SEQUENCE_PROGRAMS_PER_SM * sms if batch == 1 else ONE_WARP_PROGRAMS)
    return splits if kv_heads > 1 and splits > 1 and enough else None
