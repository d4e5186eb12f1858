"""The decode kernel's launch options per KV format, as measured on the H200.

`decode_attention_launch` takes every option left at None from here. Each row
was chosen by timing the alternatives side by side in one run
(benchmarks/kernel_variants.py; results/kernel_variants_round*.jsonl and
benchmarks/KERNEL_NOTES.md say what each option does and was worth).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kv_cache import LayerCache
from . import decode_gluon
from .formats import KIND_FLOAT, KIND_INT4, KIND_INT8, SCALE_TOKEN, KernelFormat, kernel_format
from .split_k import MIN_TOKENS_PER_SPLIT, choose_num_splits, split_tokens


class Tuned(NamedTuple):
    block_n: int
    num_stages: int
    cvt_early: bool
    dot_fp16: bool
    p_scale: bool
    swap: bool
    maxnreg: int | None  # a register cap lets 4 programs share an SM instead of 3
    resident_per_sm: int  # programs an SM holds at once (regs, shared memory): the split-K waves
    warps: bool = False  # one softmax state per warp (decode_warps.py)
    heads_n: bool = False  # there: query heads on the mma N dimension
    int8_asm: bool = False  # int8 -> fp16 through widen_ptx.widen_asm (fp16 dots only)
    pages_ahead: bool = True  # per-warp kernel: block-table entries a tile ahead (group_io._tile_pages)
    warp_page: bool = True  # per-warp kernel: one block-table read per warp where its tokens share a page
    gluon: bool = False  # the Gluon kernel (decode_gluon.py) where it supports the launch


# Fastest options per format, measured side by side on the H200 at Llama-3-8B 16 x 32k
# (benchmarks/kernel_variants.py; results/kernel_variants_round*.jsonl, KERNEL_NOTES.md),
# keyed by (kind, per-token scales, asymmetric). Times: before -> with these options, same runs.
# Round 8: static fp8/int8 on the per-warp kernel, heads on M, no register cap. Round 9: the
# block table read a tile ahead (pages_ahead: Triton's pipeline then really buffers
# num_stages - 1 tiles) and one block-table read per warp (warp_page). Round 10: one-warp
# programs of 16-token tiles (the warp's softmax state is its program's: no cross-warp merge,
# one-warp barriers), 12 resident per SM (154-168 registers): fp8 0.282 -> 0.267, int8
# 0.321 -> 0.311, int4 0.255 -> 0.249; per-token fp8 / int8 / int4 leave heads on N and their
# 128-register cap for heads on M, uncapped: 0.416 -> 0.379, 0.458 -> 0.399, 0.395 -> 0.311.
# Also faster at 64 x 8k, 128 x 4k and the 70B-TP8 shapes (int4 there -4%..+1%). int8
# per-token asym: one warp, heads on M at 2 stages (at 3: 184 registers, 0.620 ms); int4
# per-token asym keeps round 9's heads on N (one-warp variants won at 16 x 32k only, by <= 7%).
# bf16 keeps the heads x tokens kernel. Round 11 (seventh session): every quantized format
# runs the Gluon kernel (decode_gluon.py) on the GPU where it supports the launch; the other
# options here are the Triton kernels' (the interpreter, other shapes, gluon=False). The last
# times are the eighth session's Gluon kernel (kernels.md), where it changed.
TUNED = {
    ("float", False, False): Tuned(128, 2, False, False, False, False, None, 3),  # bf16/fp16: 0.49 ms
    ("fp8", False, False): Tuned(16, 3, False, True, False, False, None, 12, True, gluon=True),  # 0.524 -> 0.267 -> 0.263
    ("int8", False, False): Tuned(16, 3, False, True, False, False, None, 12, True, False, True, gluon=True),  # 0.464 -> 0.311 -> 0.267
    ("int4", False, False): Tuned(16, 3, False, False, False, False, None, 12, True, gluon=True),  # 0.432 -> 0.249 -> 0.200 -> 0.158
    ("fp8", True, False): Tuned(16, 4, False, True, True, False, None, 12, True, gluon=True),  # 0.553 -> 0.379 -> 0.270
    ("int8", True, False): Tuned(16, 3, False, True, True, False, None, 12, True, False, True, gluon=True),  # 0.691 -> 0.399 -> 0.278 -> 0.274
    ("int4", True, False): Tuned(16, 3, False, True, False, False, None, 12, True, gluon=True),  # 0.752 -> 0.311 -> 0.210 -> 0.170
    ("int8", True, True): Tuned(16, 2, False, True, True, False, None, 12, True, False, True, gluon=True),  # 0.534 -> 0.479 -> 0.286 -> 0.282
    ("int4", True, True): Tuned(64, 2, False, True, False, False, 128, 4, True, True, pages_ahead=False, gluon=True),  # 0.433 -> 0.223 -> 0.184
}

# One-warp programs need about 1024 of them to keep the memory busy: at 1 x 131072 (8 pairs)
# fp8 took 0.104 ms at 512 programs (64 splits), 0.081 at 1024 (128 splits), 0.099 at 2048,
# against 0.090 for 4-warp programs at 64 splits. Where the batch's (sequence, KV head) pairs
# cannot reach ONE_WARP_PROGRAMS with ONE_WARP_MAX_SPLITS splits of >= MIN_TOKENS_PER_SPLIT
# tokens (Llama-3-70B at TP 8 has one KV head: 0.096 vs 0.036 ms for a single sequence), the
# format's 4-warp tile runs instead: 4 x 16 tokens, 3 programs per SM (round 9) -- on the GPU for the static
# 8-bit formats only: int4 takes the Gluon kernel's ring, two tiles a step, per-token formats Gluon's registers.
ONE_WARP_PROGRAMS = 1024
ONE_WARP_MAX_SPLITS = 128


def tuned_for(kf: KernelFormat, pairs: int | None = None, max_tokens: int | None = None) -> Tuned:
    """The format's launch options; with the batch's (sequence, KV head) pairs and its longest
    context, the Triton 4-warp tile where one-warp programs would be too few (the Triton kernels' options;
    on the GPU only the static 8-bit formats leave the Gluon kernel for it)."""
    kind = "int4" if kf.kind == KIND_INT4 else "int8" if kf.kind == KIND_INT8 else "fp8" if kf.fp8 else "float"
    tuned = TUNED[(kind, kf.scale_mode == SCALE_TOKEN, bool(kf.asym))]
    one_warp = tuned.warps and tuned.block_n == 16
    if pairs is not None and (one_warp or tuned.gluon):
        splits = min(ONE_WARP_MAX_SPLITS, -(-max_tokens // MIN_TOKENS_PER_SPLIT))
        if pairs * splits < ONE_WARP_PROGRAMS:
            # 70B TP8, one sequence: the static 8-bit formats' Triton 4-warp tile beats Gluon (fp8 0.036 vs
            # 0.045 ms); per-token ones stay on Gluon (int8 0.047 vs 0.070), and so does int4, whose ring of
            # tiles two a step serves few programs (`gluon_plan`: 0.0179 against the Triton tile's 0.0321 ms)
            if kf.scale_mode != SCALE_TOKEN and kf.kind != KIND_INT4:
                tuned = tuned._replace(gluon=False)
            if one_warp:
                tuned = tuned._replace(block_n=64, resident_per_sm=3)
    return tuned


GLUON_STAGES = 2
RING_MIN_TOKENS = 1024  # int4 splits at least this long go through the ring (`gluon_stages_for`)
RING_MIN_TOKENS_ONE_HEAD = 2048  # ... where a page holds one KV head
RING_FEW_PROGRAMS = 512  # the ring for few programs makes at least this many (`_few_splits`) ...
RING_MAX_SPLITS = 512  # ... with at most this many splits (the split rule's own limit is decode_gluon.MAX_SPLITS)
GLUON_PAIR_STAGES = 4  # a ring with tiles two a step: two stages read while two fill


def gluon_pairs_for(kf: KernelFormat, tma: int = 0) -> bool:
    """Whether the int4 ring takes its tiles two a step (`gluon_attend._attend_pair`: one softmax max, rescale
    test, V scale bound and division per 32 tokens): the per-token formats, whose bookkeeping per tile is
    largest (16 x 32768: 0.1476 ms against 0.1570, asym 0.1570 against 0.1645; twelfth session); per-head int4
    where the TMA unit fills the ring (`gluon_tma_for`: 0.1363 against 0.1378 one a step, 64 x 32768 0.5131
    against 0.5219; seventeenth session), not through cp.async (0.1405 against 0.1377 ms, twelfth)."""
    return kf.kind == KIND_INT4 and (kf.scale_mode == SCALE_TOKEN or tma > 0)


def gluon_tma_for(kf: KernelFormat, capability: int) -> int:
    """What of the int4 ring the TMA unit copies (`decode_gluon.ring_descriptors`) instead of cp.async from every
    lane, on a GPU of this major compute capability: 0 nothing, 1 the K and V words, 2 those and the per-token
    scales and zero points. 2 on sm_90+ (H200, same run, against cp.async: Llama-3-8B 16 x 32768 int4 0.1378 ms
    against 0.1403, per-token 0.1430 against 0.1498, asym 0.1545 against 0.1584; 64 x 32768 1.4 / 3.7 / 3.2%;
    Llama-3-70B TP8 1 x 131072 int4 0.0154 against 0.0179, per-token 0.0163 against 0.0185; 8B 1 x 32768
    per-token 2% slower; seventeenth session); Ampere has no TMA."""
    return 2 if kf.kind == KIND_INT4 and capability >= 9 else 0


# Among split counts > 1 the Gluon kernel takes the fewest within 5% of the best by the wave model: at
# 16 x 32768, 16 splits (2048 programs) beat 15 by 2-3% for int4 and ~1% for the 8-bit formats. Splitting
# at all must win 10% (the split rule's default): 14 splits instead of 1 for int8 per-token at 183 x 8448
# (12 per SM, 5% by the model) cost the headline's decode 5% (KERNEL_NOTES.md, ninth and tenth sessions).
GLUON_SPLIT_TOLERANCE = 0.05


def gluon_stages_for(kf: KernelFormat, tokens_per_split: int, kv_heads: int) -> int:
    """Stages of the Gluon kernel's shared-memory ring (0: tiles loaded into registers a step ahead).
    int4 with splits of >= RING_MIN_TOKENS: 2 (16 x 32768: per-head 0.149 ms against 0.156 from registers,
    3 stages 0.155, ninth session; per-token 0.157 against 0.163, asym 0.165 against 0.175 with the scales
    and zero points in the ring, eleventh). Short splits (Llama-3-70B at TP 8: 256 tokens) ran slower
    with it (per-token: 0.040 against 0.034 ms). With one KV head (70B TP8) splits of 1024 tokens did too
    (64 x 32768: int4 0.0853 against 0.0805, per-token 0.0971 against 0.0911); splits of 2048 ran within 1.5% for
    int4 and faster for the per-token formats (128 x 32768: int4 0.1535 against 0.1512, per-token 0.1676 against
    0.1718, asym 0.1789 against 0.1879; sixteenth session): RING_MIN_TOKENS_ONE_HEAD."""
    least = RING_MIN_TOKENS_ONE_HEAD if kv_heads == 1 else RING_MIN_TOKENS
    ring = kf.kind == KIND_INT4 and tokens_per_split >= least
    return GLUON_STAGES if ring else 0


def gluon_plan(kf: KernelFormat, batch: int, kv_heads: int, max_tokens: int, sms: int, maxnreg: int | None = None,
               stages: int | None = None, num_splits: int | None = None,
               resident_per_sm: int | None = None, pairs: bool | None = None,
               group: int = 4, tma: int = 0) -> tuple[int | None, int, int, bool]:
    """The Gluon kernel's (register cap, split count, ring stages, tiles two a step); arguments not None are
    kept. int4 is planned for the ring first (its register cap sets the programs per SM the split rule
    counts on); where the split rule's splits are too short for the ring: the ring with tiles two a step all the same
    if they make <= ONE_WARP_PROGRAMS programs (at least RING_FEW_PROGRAMS: `_few_splits`; Llama-3-70B TP8 1 x
    131072: int4 0.0196 ms at the rule's 244 splits against 0.0301 from registers and 0.0316 on the Triton tile; 8B
    1 x 32768 0.0171 against 0.0205 and 0.0265; sixteenth session), else with splits of RING_MIN_TOKENS if those
    still make ONE_WARP_PROGRAMS programs (`_long_splits`), else the registers. pairs: the ring's
    tiles two a step (`gluon_pairs_for`), with splits of whole tile pairs and >= GLUON_PAIR_STAGES stages. group:
    query heads per KV head (the register cap depends on it: `gluon_registers`). tma: what of the ring the TMA
    unit copies (`gluon_tma_for`; per-head int4 takes pairs with it)."""
    if stages and kf.kind != KIND_INT4:
        raise ValueError(f"gluon_stages={stages}: the shared-memory ring serves int4 formats only; "
                         f"pass gluon_stages=0 or None for this format")

    def plan(ring: bool, splits: int | None = num_splits, pairs: bool | None = pairs,
             short: bool = False) -> tuple[int | None, int, int, bool]:  # short: the ring for splits of any length
        two = ring and (gluon_pairs_for(kf, tma) if pairs is None else bool(pairs))
        tile = decode_gluon.TILE * (2 if two else 1)
        cap, resident = gluon_registers(kf, maxnreg, ring, group)
        if splits is None:
            splits = choose_num_splits(batch, kv_heads, max_tokens, tile, sms, resident_per_sm or resident,
                                       decode_gluon.MIN_TOKENS_PER_SPLIT, decode_gluon.MAX_SPLITS,
                                       refine_tolerance=GLUON_SPLIT_TOLERANCE)
        if stages is None:
            ring_stages = 0 if not ring else GLUON_STAGES if short else gluon_stages_for(
                kf, split_tokens(max_tokens, splits, tile), kv_heads)
            ring_stages = max(ring_stages, GLUON_PAIR_STAGES) if two and ring_stages else ring_stages
        else:
            ring_stages = stages
        if two and ring_stages < GLUON_PAIR_STAGES:
            if ring_stages and pairs:
                raise ValueError(f"gluon_pairs needs a ring of >= {GLUON_PAIR_STAGES} stages, got {ring_stages}: "
                                 f"pass gluon_stages={GLUON_PAIR_STAGES} or gluon_pairs=False")
            two = False
        return cap, splits, ring_stages, two

    if kf.kind == KIND_INT4 and stages != 0:
        ring_plan = plan(True)
        if ring_plan[2]:
            return ring_plan
        if num_splits is None:
            # few programs: the ring of tiles two a step at the split rule's count, where registers hold one tile
            # in flight a program; else, with more than one KV head, splits of RING_MIN_TOKENS
            few = batch * kv_heads * ring_plan[1] <= ONE_WARP_PROGRAMS
            splits = _few_splits(batch * kv_heads, max_tokens, ring_plan[1]) if few else _long_splits(
                batch, kv_heads, max_tokens)
            if few or splits:
                return plan(True, splits, True if pairs is None else pairs, short=few)
    return plan(False)


def _few_splits(pairs: int, max_tokens: int, splits: int) -> int:
    """The split rule's count for the ring of few programs, raised to make RING_FEW_PROGRAMS programs where splits
    of MIN_TOKENS_PER_SPLIT allow, up to RING_MAX_SPLITS. Llama-3-70B TP8 1 x 131072: 512 splits of 256 tokens
    ran 0.0176 ms against 0.0193 for the rule's 244 (per-token 0.0184 against 0.0220, asym 0.0187 against
    0.0229), while 2 x 131072 ran 0.0236 with 2 x 244 programs against 0.0259 with 2 x 512 (sixteenth session)."""
    want = -(-RING_FEW_PROGRAMS // pairs)
    return max(splits, min(want, max_tokens // decode_gluon.MIN_TOKENS_PER_SPLIT, RING_MAX_SPLITS))


def _long_splits(batch: int, kv_heads: int, max_tokens: int) -> int | None:
    """Splits of RING_MIN_TOKENS for int4 where the split rule's are too short for the ring, if that leaves >=
    ONE_WARP_PROGRAMS (sequence, KV head, split) programs: half the H200's slots at 16 a SM, each with two tiles
    in flight (the 4-stage ring of tiles two a step, per-head int4 too). Llama-3-8B at 1 x 131072 (8 KV heads):
    128 splits in the ring instead of 244 from registers, int4 0.0447 -> 0.0417 ms, per-token 0.0504 -> 0.0445,
    asym 0.0522 -> 0.0491; per-head int4 with 128 splits but one tile a step ran 0.0492 (thirteenth session).
    Not with one KV head (Llama-3-70B at TP 8), where the registers at the split rule's count ran faster at
    32 x 32768 (int4 0.0454 against 0.0506 ms, per-token 0.0512 against 0.0533, asym 0.0540 against 0.0568;
    sixteenth session). The probe `probes/ring_read.py` reads those lone 1 KB pages through the ring's 1024-token
    splits at 81% (32 x 32768) and 92% (64 x 32768) of a same-size read, Llama-3-8B's at 16 x 32768 (8 KV heads,
    4096-token splits) at 100%. Measured at 1, 4 and 8 KV heads."""
    splits = max_tokens // RING_MIN_TOKENS
    return splits if kv_heads > 1 and splits > 1 and batch * kv_heads * splits >= ONE_WARP_PROGRAMS else None


def gluon_offsets32(kf: KernelFormat, cache_words: int) -> bool:
    """Whether the Gluon kernel computes page offsets in int32 (the cache holds < 2^31 words): ~17 fewer
    instructions a tile, but fp8 per-token spills at its 128-register cap with them (0.320 ms against
    0.267 at 16 x 32768)."""
    return cache_words < 2**31 and not (kf.kind == KIND_FLOAT and kf.scale_mode == SCALE_TOKEN)


def gluon_k_chains_for(kf: KernelFormat) -> int:
    """Independent chains of mma the Gluon kernel computes a tile's scores in (`gluon_operands._k_operands`: k in
    1, 2 or 4 blocks; one chain of 8 m16n8k16 waits on each result in turn). 2 for symmetric int8 per-token, the
    one-tile-a-step format with the fewest programs per SM (uncapped, 12): 1.0-1.2% faster at every Llama-3-8B
    shape (16 x 32768 0.2660 -> 0.2630 ms, 128 x 4096 0.2757 -> 0.2728, 1 x 131072 0.0740 -> 0.0731) and
    Llama-3-70B TP8 (0.0426 -> 0.0421). Elsewhere within +-0.5% (asym int8, fp8 per-token, int4 at 16 per SM) or
    slower (4 chains; fp8 at Llama-3-70B TP8; fifteenth session, KERNEL_NOTES.md)."""
    return 2 if kf.kind == KIND_INT8 and kf.scale_mode == SCALE_TOKEN and not kf.asym else 1


def skip_rescale_for(kf: KernelFormat) -> bool:
    """Whether the Gluon kernel (decode_gluon.py) skips the softmax rescale of tiles that raise no column's max: int4, and
    the int8 per-token formats (uncapped). fp8 and the 8-bit static formats spill at their
    128-register cap with the branch, and read at 96-99% of bandwidth without it."""
    return kf.kind == KIND_INT4 or (kf.kind != KIND_FLOAT and kf.scale_mode == SCALE_TOKEN)


# fp8 per-token fits 128 registers for GQA groups of 2-7 only: for 1 and 8 ptxas (Triton 3.6) spills 64 bytes in
# the tile loop (372 loop instructions against 325), and uncapped (167 registers, 12 programs per SM) ran 0.0436
# ms against 0.0523 at Llama-3-70B TP8 (group 8) 16 x 32768, 0.0359 against 0.0547 at 1 x 131072 (thirteenth
# session). tests/helpers_gluon_compile.py builds every format at groups 1, 4 and 8 (fp8 per-token at all eight)
# and fails where a cap spills in the loop.
FP8_TOKEN_CAP_GROUPS = range(2, 8)


def gluon_registers(kf: KernelFormat, maxnreg: int | None = None, ring: bool = False,
                    group: int = 4) -> tuple[int | None, int]:
    """The Gluon kernel's (register cap, programs per SM). 128 registers hold 16 one-warp programs per SM
    (so does the int4 ring's 106: at 96, 20 per SM ran no faster; KERNEL_NOTES.md, tenth session); the
    per-token int8 and asymmetric int4 kernels would spill at 128 and run faster uncapped (140-168
    registers, 12 per SM) -- except asymmetric int4 through the ring (`ring`): 125 registers at a cap of 128
    with tiles two a step (118 one a step), 16 per SM: one a step ran 0.165 ms against 0.167 uncapped at
    16 x 32768 -- and fp8 per-token where it would spill at 128 (`FP8_TOKEN_CAP_GROUPS`; group: query heads per
    KV head). maxnreg: an explicit cap instead (0: none)."""
    if maxnreg is None:  # symmetric int4 per-token fits 120: 0.170 vs 0.191 ms uncapped
        if kf.kind == KIND_FLOAT and kf.scale_mode == SCALE_TOKEN and group not in FP8_TOKEN_CAP_GROUPS:
            maxnreg = 0
        elif kf.scale_mode != SCALE_TOKEN or kf.kind == KIND_FLOAT or (ring and kf.asym):
            maxnreg = 128
        else:
            maxnreg = 120 if kf.kind == KIND_INT4 and not kf.asym else 0
    if not maxnreg:
        return None, 12
    return maxnreg, programs_per_sm(maxnreg)


def programs_per_sm(registers: int) -> int:
    """One-warp programs an H100/H200 SM holds at `registers` per thread. A warp's registers come from
    one of the SM's 4 sub-partitions (16k registers each), allocated 8 per thread at a time, so
    every cap from 104 to 128 holds 16 (the driver's occupancy count for the 106- and 123-register
    builds; KERNEL_NOTES.md, ninth session), 96 holds 20; an SM runs at most 32 programs."""
    per_warp = 32 * -(-registers // 8) * 8
    return min(32, 4 * (16384 // per_warp))


def probability_dtype(cache: LayerCache, q_dtype: torch.dtype) -> torch.dtype:
    """The dtype the default launch rounds softmax probabilities to before p . V (on the GPU; the
    Gluon kernel, which serves head_dim 128 and pages of 16k tokens, dots in fp16)."""
    kf = kernel_format(cache)
    tuned = tuned_for(kf)
    gluon = tuned.gluon and decode_gluon.serves(kf, cache.block_size, 1)  # the GQA group is not known here
    return torch.float16 if tuned.dot_fp16 or gluon else q_dtype
