"""Kernel plans: everything a launch decides before it runs, made once per (format, shape, device) and run many times.

A plan is a frozen dataclass (`DecodePlan`, `WritePlan`, `PrefillPlan`) made by one function each (`decode_plan`,
`write_plan`, `prefill_plan`) from the KV format, the batch's shape and the device; the public ops
(`launch.py`) take `plan=` or make the default one. Benchmarks and tests vary a plan with `dataclasses.replace`.
The per-format choices come from the device's tuned file (`tuned_file.py`: tuned/<device>.json, written by
benchmarks/tune.py; the H200's serves every other device and the interpreter), the shape-dependent rules from
`tuning.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton

from ..kv_format import KVFormat
from . import codes, decode_channel_keys_gluon, decode_gluon, tuning
from .formats import format_codes, kernel_format, served_by_mixed
from .split_k import choose_num_splits
from .tuned_file import DEVICE_H200, Device, device_of, format_tuned, tuned_for_device

KERNELS = ("gluon", "warps", "tiles")  # decode_gluon.py, decode_warps.py, decode_tiles.py
MIXED = "mixed"  # decode_mixed.py: the formats of `formats.served_by_mixed`, and only those
CHANNEL_KEYS = "channel_keys"  # decode_channel_keys.py: per-channel keys (KIVI), and only those
CHANNEL_KEYS_GLUON = "channel_keys_gluon"  # decode_channel_keys_gluon.py: those on the GPU (head_dim 128, group <= 8)
# decode_channel_keys_gluon.py: a register cap of 168 (12 one-warp programs an SM, `tuning.programs_per_sm`), which the
# split rule counts on; two mma chains a tile's scores
CHANNEL_KEYS_GLUON_REGISTERS = 168
CHANNEL_KEYS_GLUON_K_CHAINS = 2
# on sm_90, tiles through a shared-memory ring of this many stages filled by TMA: 3.32x cuDNN BF16 at Llama-3-8B
# 16 x 32768 on an H100 against 3.02x with the tiles in registers a step ahead (kernels_channel_keys.md)
CHANNEL_KEYS_GLUON_STAGES = 4
# programs of decode_channel_keys.py counted an SM for the split rule: 8 measured best of 4-32 on an H100 at
# Llama-3-8B 16 x 32768 and 64 x 8192 (benchmarks/results/kernels_channel_keys.md)
CHANNEL_KEYS_RESIDENT_PER_SM = 8


@dataclass(frozen=True)
class DecodePlan:
    """How `decode_attention` runs. kernel: "gluon" (decode_gluon.py: one warp a program, hand-placed layouts; CUDA,
    head_dim 128, <= 8 query heads per KV head, pages of 16k tokens, quantized formats, fp16 / bf16 q), "warps"
    (decode_warps.py: one softmax state per warp; quantized formats) or "tiles" (decode_tiles.py: query heads x tokens;
    unquantized formats) or "mixed" (decode_mixed.py: the formats of `formats.served_by_mixed`; "gluon" serves
    those of them it is written for: `mixed_gluon_serves`) or "channel_keys" (decode_channel_keys.py: per-channel
    keys; block_n is their block of 64 positions) or "channel_keys_gluon" (decode_channel_keys_gluon.py: those on the
    GPU; k_chains and skip_rescale as the Gluon kernel's). splits: split-K ranges per sequence (`split_k`). registers: a register cap per thread
    (None: none; GPU only). split_tokens: splits of exactly this many tokens (a multiple of `split_tile`) whatever the
    table's width, each row's merged in order (`split_k.merge_in_order`), in place of `splits`: a row's result then
    depends on its own length only (the batch-invariant mode, invariant_attention.py); 0: `splits` decides.

    Gluon kernel: stages: int4 tiles through a shared-memory ring of this many stages (0: registers a step ahead);
    pairs: the ring's tiles two a step (stages >= 4); tma: the TMA unit fills the ring (sm_90); k_chains: a tile's
    scores as 1 or 2 independent mma chains; skip_rescale: skip the softmax rescale of tiles that raise no max;
    offsets32: int32 page offsets where the cache holds < 2^31 words.

    Triton kernels: block_n: tokens a tile (warps: 16 a warp); num_warps, num_stages: Triton's; dot_fp16: dots in fp16
    whatever q's dtype (exact for raw 8-/4-bit values); p_scale: per-token V scales multiply p, V stays raw;
    widen_ptx: int8 / int4 widened by the PTX of `widen_ptx.widen_asm`; heads_n (warps): query heads on the mma N
    dimension; pages_ahead (warps): block-table entries a tile ahead; warp_page (warps): one block-table read per
    warp, its tokens sharing a page.
    """

    kernel: Literal["gluon", "warps", "tiles", "mixed", "channel_keys", "channel_keys_gluon"]
    splits: int
    registers: int | None = None
    stages: int = 0
    pairs: bool = False
    tma: bool = False
    k_chains: int = 1
    skip_rescale: bool = False
    offsets32: bool = False
    block_n: int = 16
    num_warps: int = 1
    num_stages: int = 2
    dot_fp16: bool = False
    p_scale: bool = False
    widen_ptx: bool = False
    heads_n: bool = False
    pages_ahead: bool = True
    warp_page: bool = True
    split_tokens: int = 0


def split_tile(plan: DecodePlan) -> int:
    """Tokens a split of `plan`'s launch is a multiple of (`split_k.split_plan`): the Gluon kernel's tile, two with
    pairs; the Triton kernels' block_n."""
    return decode_gluon.TILE * (2 if plan.pairs else 1) if plan.kernel == "gluon" else plan.block_n


def dot_mode(q_dtype: torch.dtype, device: Device) -> int:
    if q_dtype == torch.float32:
        return codes.DOT_IEEE
    if q_dtype == torch.bfloat16 and device.interpret:
        return codes.DOT_UPCAST
    return codes.DOT_NATIVE


def gluon_serves(fmt: KVFormat, device: Device, q_dtype: torch.dtype, block_size: int, group: int,
                 head_dim: int) -> bool:
    """Whether the Gluon kernel can run this launch (`decode_gluon.serves`, on CUDA outside the interpreter, with
    fp16 / bf16 q)."""
    return (device.cuda and not device.interpret and q_dtype in (torch.float16, torch.bfloat16)
            and decode_gluon.serves(format_codes(fmt, head_dim), block_size, group))


def mixed_gluon_serves(fmt: KVFormat, device: Device, q_dtype: torch.dtype, block_size: int, group: int,
                       head_dim: int) -> bool:
    """Whether the Gluon kernel can run this launch of a format of `formats.served_by_mixed` (`decode_gluon.
    serves_mixed`: K/V-split with per-token scales, group 64, int4 group 32; head_dim 128, on CUDA outside the
    interpreter, with fp16 / bf16 q). Its tuned entry's `gluon` switches it on: false sends the format back to decode_mixed.py."""
    return (device.cuda and not device.interpret and q_dtype in (torch.float16, torch.bfloat16)
            and decode_gluon.serves_mixed(format_codes(fmt.side("k"), head_dim), format_codes(fmt.side("v"), head_dim),
                                          block_size, group))


def decode_plan(fmt: KVFormat, batch: int, heads: int, kv_heads: int, max_tokens: int,
                device: Device | torch.device | str = DEVICE_H200, *, head_dim: int = 128, block_size: int = 16,
                q_dtype: torch.dtype = torch.bfloat16,
                kernel: Literal["gluon", "triton"] | None = None) -> DecodePlan:
    """The default plan for `batch` sequences of up to `max_tokens` (the block table's width in tokens), `heads` query
    heads over `kv_heads` KV heads of `head_dim`, pages of `block_size` tokens, on `device`. kernel: the plan of that
    kernel family instead of the default choice ("triton": the format's Triton kernel, warps or tiles), for tests
    and benchmarks that compare kernels."""
    device = device if isinstance(device, Device) else device_of(device)
    if fmt.per_channel_keys:
        if kernel != "triton" and decode_channel_keys_gluon.serves(device, q_dtype, heads // kv_heads, head_dim):
            splits = tuning.gluon_splits(batch, kv_heads, max_tokens, block_size, device.sms,
                                         CHANNEL_KEYS_GLUON_REGISTERS)
            tma = device.capability >= 9  # elsewhere the tiles stay in registers (a cp.async ring is unmeasured)
            return DecodePlan(CHANNEL_KEYS_GLUON, splits, CHANNEL_KEYS_GLUON_REGISTERS,
                              CHANNEL_KEYS_GLUON_STAGES if tma else 0, tma=tma, block_n=block_size,
                              k_chains=CHANNEL_KEYS_GLUON_K_CHAINS, skip_rescale=True)
        splits = choose_num_splits(batch, kv_heads, max_tokens, block_size, device.sms, CHANNEL_KEYS_RESIDENT_PER_SM)
        native = device.cuda and not device.interpret and q_dtype in (torch.float16, torch.bfloat16)
        # one-warp programs where the (sequence, KV head) pairs alone fill the GPU, two where splits must
        warps = 1 if batch * kv_heads >= device.sms else 2
        return DecodePlan(CHANNEL_KEYS, splits, block_n=block_size, num_warps=warps, num_stages=2, dot_fp16=native,
                          widen_ptx=native)
    tuned = format_tuned(fmt, device).decode
    if served_by_mixed(fmt):
        group = heads // kv_heads
        if kernel == "gluon" or (kernel is None and tuned.gluon
                                 and mixed_gluon_serves(fmt, device, q_dtype, block_size, group, head_dim)):
            kf = format_codes(fmt.side("k"), head_dim)
            if tuning.gluon_group_ring(kf, device.capability):  # int4 group scales: the TMA ring
                cap = tuned.ring_registers or None
                splits = tuning.gluon_splits(batch, kv_heads, max_tokens, decode_gluon.TILE, device.sms, cap)
                return DecodePlan("gluon", splits, cap, tuning.GROUP_RING_STAGES, tma=True, k_chains=tuned.k_chains,
                                  skip_rescale=tuned.skip_rescale, offsets32=tuned.offsets32)
            # K's codes drive the rules (its register cap, the split count); the tiles load into registers
            cap, splits, _, _ = tuning.gluon_plan(kf, batch, kv_heads, max_tokens, device.sms, group, False,
                                                  tuned.registers, tuned.registers)
            return DecodePlan("gluon", splits, cap, k_chains=tuned.k_chains, skip_rescale=tuned.skip_rescale,
                              offsets32=tuned.offsets32)
        splits = choose_num_splits(batch, kv_heads, max_tokens, tuned.block_n, device.sms, tuned.resident_per_sm)
        return DecodePlan(MIXED, splits, tuned.tile_registers or None, block_n=tuned.block_n,
                          num_warps=min(4, tuned.block_n // 16), num_stages=tuned.num_stages)
    kf = format_codes(fmt, head_dim)
    group = heads // kv_heads
    one_warp = tuned.warps and tuned.block_n == 16
    gluon, block_n, resident = tuned.gluon, tuned.block_n, tuned.resident_per_sm
    if (one_warp or gluon) and tuning.one_warp_too_few(batch * kv_heads, max_tokens):
        gluon = gluon and tuning.gluon_for_few_programs(kf)
        if one_warp:  # the format's 4-warp tile: 4 x 16 tokens, 3 programs per SM
            block_n, resident = 64, 3
    if kernel is not None:
        gluon = kernel == "gluon"
    if kernel == "gluon" or (gluon and gluon_serves(fmt, device, q_dtype, block_size, group, head_dim)):
        tma = tuning.gluon_tma_for(kf, device.capability)
        cap, splits, stages, pairs = tuning.gluon_plan(kf, batch, kv_heads, max_tokens, device.sms, group, tma,
                                                       tuned.registers, tuned.ring_registers)
        return DecodePlan("gluon", splits, cap, stages, pairs, tma and stages > 0, tuned.k_chains, tuned.skip_rescale,
                          tuned.offsets32)
    dot = dot_mode(q_dtype, device)
    stored = fmt.stored_head_dim(head_dim)
    block_d = max(16, triton.next_power_of_2(stored))
    # why: the PTX widening is validated on the GPU for tiles of >= 64 tokens x >= 64 stored columns only (16-token
    # tiles of the heads x tokens kernel, or head_dim 16, gave wrong int8 / int4 results on the H200); the per-warp
    # kernel's warps always hold 16-token tiles; measured: benchmarks/results/kernel_variants.jsonl (rule=tuned_for)
    fast_tile = (block_n >= 64 or tuned.warps) and block_d >= 64
    dot_fp16 = tuned.dot_fp16 and dot == codes.DOT_NATIVE  # fp16 dots need native tensor-core dots
    widen = dot == codes.DOT_NATIVE and device.cuda and fast_tile and (
        kf.kind == codes.INT4 or (kf.kind == codes.INT8 and tuned.int8_asm and dot_fp16))
    num_warps = min(4, block_n // 16) if tuned.warps else 4
    one_warp_splits = {"max_splits": tuning.ONE_WARP_MAX_SPLITS} if tuned.warps and num_warps == 1 else {}
    splits = choose_num_splits(batch, kv_heads, max_tokens, block_n, device.sms, resident, **one_warp_splits)
    return DecodePlan(
        "warps" if tuned.warps else "tiles", splits, tuned.tile_registers or None, block_n=block_n,
        num_warps=num_warps, num_stages=tuned.num_stages, dot_fp16=dot_fp16,
        p_scale=tuned.p_scale and kf.scale_mode == codes.PER_TOKEN, widen_ptx=widen, heads_n=tuned.heads_n,
        pages_ahead=tuned.pages_ahead,
        warp_page=tuned.warp_page and warp_page_fits(block_n, num_warps, block_size))


def warp_page_fits(block_n: int, num_warps: int, block_size: int) -> bool:
    """Whether a warp's tokens of a tile share one page (`DecodePlan.warp_page`): they start at multiples of their
    count, which divides the page size."""
    return block_n % num_warps == 0 and block_size % (block_n // num_warps) == 0


@dataclass(frozen=True)
class WritePlan:
    """How `write_kv` runs. block_t: tokens a program; num_warps: Triton's; fast: the GPU's exact shortcuts (the
    hardware fp8 conversion, division through the reciprocal, `cvt.rni` rounding; same bytes; not in the
    interpreter); lanes: whole rows over this many lanes (2 / 4 / 8 / 16; 0: the [tokens, head_dim] tile; the
    mixed write's group-scaled sides take group_size / 8, `mixed_row_lanes`); packed: with lanes, the rows'
    reductions on bf16 pairs / bytes stored from words (bf16 k / v, fp16 per-token scales, fast)."""

    block_t: int
    num_warps: int
    fast: bool
    lanes: int = 0
    packed: bool = False


def bad_plan(plan, field: str, why: str) -> ValueError:
    return ValueError(f"{type(plan).__name__}.{field}={getattr(plan, field)!r}: {why}; make the plan with "
                      f"runtime.kernels.{type(plan).__name__.lower().replace('plan', '_plan')} and change it with "
                      f"dataclasses.replace")


def check_fast_write(plan: WritePlan, device: torch.device) -> None:
    if plan.fast and (device.type != "cuda" or device_of(device).interpret):
        raise bad_plan(plan, "fast", "the GPU's shortcuts need CUDA outside the interpreter")


def rows_fit(head_dim: int, lanes: int) -> bool:
    """Whether rows over `lanes` lanes fit head_dim: a power of two of >= 8 columns a lane."""
    return head_dim & (head_dim - 1) == 0 and head_dim >= 8 * lanes


def mixed_row_lanes(fmt: KVFormat, head_dim: int, lanes: int, fast: bool = True,
                    x_dtype: torch.dtype | None = torch.bfloat16) -> tuple[int, int] | None:
    """The lanes a row of K and of V takes in the mixed write's row layout (`write_mixed._side_write`), or None where
    it does not serve: the GPU's shortcuts (fast), bf16 k / v (x_dtype), per-token scales in fp16 on both sides; a
    side with group scales takes group_size / 8 lanes (a group is one c of the row tile), the other `lanes`."""
    if not (lanes and fast and x_dtype == torch.bfloat16) or fmt.scale_dtype != "float16":
        return None
    sides = [fmt.side(which) for which in ("k", "v")]
    if any(s.granularity != "per_token" or not s.dynamic for s in sides):
        return None
    out = tuple(s.group_size // 8 if s.group_size else lanes for s in sides)
    return out if all(n >= 2 and n & (n - 1) == 0 and rows_fit(head_dim, n) for n in out) else None


def write_plan(fmt: KVFormat, tokens: int, kv_heads: int, device: Device | torch.device | str = DEVICE_H200, *,
               head_dim: int = 128, k_dtype: torch.dtype = torch.bfloat16) -> WritePlan:
    """The default plan for writing `tokens` tokens of `kv_heads` KV heads."""
    device = device if isinstance(device, Device) else device_of(device)
    tuned = format_tuned(fmt, device).write
    fast = device.cuda and not device.interpret
    block_t = 16 if tokens >= 16 * kv_heads else 4
    if served_by_mixed(fmt):  # write_mixed.py: rows over lanes where they fit, else the [tokens, head_dim] tile
        rows = tuned.packed and mixed_row_lanes(fmt, head_dim, tuned.lanes, fast, k_dtype)
        lanes = tuned.lanes if rows else 0
        # why: two warps whatever the lanes: groups of 64 (8 lanes, two rows a thread) at 16 tokens ran 70% of copy on
        # 2 warps, 64% on 4 (H200; H100 91% / 83%); measured: benchmarks/results/write_mixed_rows.md
        warps = max(1, min(2, min(rows) * block_t // 32)) if rows else write_warps(0, block_t)
        return WritePlan(block_t, warps, fast, lanes, bool(rows))
    kf = format_codes(fmt, head_dim)
    words = fast and k_dtype == torch.bfloat16 and kf.scale_mode == codes.PER_TOKEN and kf.scale_dtype == 0
    if kf.kind == codes.INT4:
        lanes = tuned.lanes if rows_fit(head_dim, tuned.lanes) else 0
        packed = bool(tuned.packed and lanes and words)
    else:  # int8 / fp8 rows store bytes from bf16 words: only there
        lanes = tuned.lanes if tuned.lanes and words and rows_fit(head_dim, tuned.lanes) else 0
        packed = bool(lanes)
    return WritePlan(block_t, write_warps(lanes, block_t), fast, lanes, packed)


def write_warps(lanes: int, block_t: int) -> int:
    """The write kernel's warps: a row per `lanes` threads, so 8 lanes x 16 tokens fill 4 warps, fewer tokens fewer
    warps; the tile (lanes 0) takes 2."""
    return max(1, min(4 if lanes == 8 else 2, lanes * block_t // 32)) if lanes else 2


@dataclass(frozen=True)
class PrefillPlan:
    """How `prefill_context_attention` runs. block_m: rows a program, chunk tokens x the GQA group (a power of two
    >= 16, raised to the group's); block_n: tokens a K/V tile (a power of two >= 16); num_warps, num_stages: Triton's;
    p_scale: per-token V scales multiply p so the p . V dot runs on raw V (symmetric per-token formats, bf16 q)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    p_scale: bool = False


def prefill_plan(fmt: KVFormat, device: Device | torch.device | str = DEVICE_H200, *,
                 q_dtype: torch.dtype = torch.bfloat16) -> PrefillPlan:
    """The default plan for a chunked prefill with q of `q_dtype`.
    why: p_scale ran 4-7% faster for int8 per-token at every context and chunk; never asymmetric (two large terms
    cancel: int4 per-token asym's error grew to 0.26 at 128k), fp16 q (p s can leave fp16's range) or fp32 q (parity
    runs); measured: benchmarks/results/prefill_context.jsonl (rule=p_scale)"""
    device = device if isinstance(device, Device) else device_of(device)
    tile = tuned_for_device(device).prefill["fp32" if q_dtype == torch.float32 else "16bit"]
    p_scale = fmt.dynamic and not served_by_mixed(fmt) and fmt.symmetric and q_dtype == torch.bfloat16
    return PrefillPlan(tile.block_m, tile.block_n, tile.num_warps, tile.num_stages, p_scale)


def probability_dtype(cache, q_dtype: torch.dtype) -> torch.dtype:
    """The dtype the default decode launch rounds softmax probabilities to before p . V on the GPU (fp16 in the Gluon
    kernel, which serves head_dim 128 and pages of 16k tokens, and in the Triton kernels' fp16 dots), for reference
    runs that mimic it."""
    if served_by_mixed(cache.fmt):  # the Gluon kernel's fp16 p (K/V-split formats it serves), else q's dtype
        tuned = format_tuned(cache.fmt, DEVICE_H200).decode
        gluon = tuned.gluon and mixed_gluon_serves(cache.fmt, DEVICE_H200, q_dtype, cache.block_size, 1,
                                                   cache.k.shape[-1] * (2 if cache.fmt.side("k").dtype == "int4" else 1))
        return torch.float16 if gluon else q_dtype
    kf = kernel_format(cache)
    tuned = format_tuned(cache.fmt, DEVICE_H200).decode
    gluon = tuned.gluon and decode_gluon.serves(kf, cache.block_size, 1)  # the GQA group is not known here
    return torch.float16 if tuned.dot_fp16 or gluon else q_dtype
