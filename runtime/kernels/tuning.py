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
from .formats import KIND_INT4, KIND_INT8, SCALE_TOKEN, KernelFormat, kernel_format


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
    int8_asm: bool = False  # int8 -> fp16 through dequant._widen_asm (fp16 dots only)
    pages_ahead: bool = True  # per-warp kernel: block-table entries a tile ahead (group_io._tile_pages)
    warp_page: bool = True  # per-warp kernel: one block-table read per warp where its tokens share a page


# Fastest options per format, measured side by side on the H200 at Llama-3-8B 16 x 32k
# (benchmarks/kernel_variants.py; results/kernel_variants_round*.jsonl, KERNEL_NOTES.md),
# keyed by (kind, per-token scales). Times: before -> with these options, same runs.
# Round 8: static fp8/int8 on the per-warp kernel, heads on M, no register cap (167 registers,
# 3 programs per SM). Round 9: with the block table read a tile ahead (pages_ahead) Triton's
# pipeline really buffers num_stages - 1 tiles (it had one buffer at any stage count), and with
# one block-table read per warp (warp_page) the fp8 tile loop is 714 -> 601 instructions:
# fp8 0.356 -> 0.288, int8 0.371 -> 0.325, and int4 per-head moves to the same kernel
# (0.298 -> 0.261 at 3 programs per SM). bf16 keeps the heads x tokens kernel at 2 stages (its
# 3 stages were one buffer too; two real ones take 139 KB: one program per SM, 0.49 -> 0.54).
# Per-token formats stay capped at 128 registers with heads on N and their V through registers;
# pages_ahead and warp_page lengthen their spills there (0.46 -> 0.51 int8 per token), except
# warp_page for int4 (0.448 -> 0.435). resident_per_sm from the sm_90 compile of each row
# (H200: 64K registers, 228 KB shared memory per SM): 167-168 registers -> 3; capped -> 4.
TUNED = {
    ("float", False): Tuned(128, 2, False, False, False, False, None, 3),  # bf16/fp16: 0.49 ms
    ("fp8", False): Tuned(64, 3, False, True, False, False, None, 3, True),  # 0.524 -> 0.392 -> 0.356 -> 0.288 ms
    ("int8", False): Tuned(64, 3, False, True, False, False, None, 3, True, False, True),  # 0.464 -> 0.371 -> 0.325
    ("int4", False): Tuned(64, 3, False, False, False, False, None, 3, True),  # 0.432 -> 0.296 -> 0.261 ms
    ("fp8", True): Tuned(64, 2, False, True, True, False, 128, 4, True, True, pages_ahead=False, warp_page=False),  # 0.553 -> 0.419 ms
    ("int8", True): Tuned(64, 2, False, True, True, False, 128, 4, True, True, True, pages_ahead=False,
                          warp_page=False),  # 0.691 -> 0.618 -> 0.474 ms
    ("int4", True): Tuned(64, 2, False, True, False, False, 128, 4, True, True, pages_ahead=False),  # asym 0.752 -> 0.479 -> 0.451
}


def tuned_for(kf: KernelFormat) -> Tuned:
    kind = "int4" if kf.kind == KIND_INT4 else "int8" if kf.kind == KIND_INT8 else "fp8" if kf.fp8 else "float"
    return TUNED[(kind, kf.scale_mode == SCALE_TOKEN)]


def probability_dtype(cache: LayerCache, q_dtype: torch.dtype) -> torch.dtype:
    """The dtype the default launch rounds softmax probabilities to before p . V (on the GPU)."""
    return torch.float16 if tuned_for(kernel_format(cache)).dot_fp16 else q_dtype
