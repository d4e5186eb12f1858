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


# Fastest options per format, measured side by side on the H200 at Llama-3-8B 16 x 32k
# (benchmarks/kernel_variants.py; results/kernel_variants_round*.jsonl, KERNEL_NOTES.md),
# keyed by (kind, per-token scales). Times: before -> with these options, same runs; the last
# step of the 8-bit and per-token formats is the per-warp kernel (round 7; int8 widened in
# PTX), which did not win for bf16 (0.494 -> 0.50-0.61) or int4 per-head (0.297 -> 0.297-0.30).
# Static fp8/int8 (round 8): heads on M, 3 stages and no register cap -- K and V both through
# cp.async at 167 registers -- at the split count for 3 programs per SM (93 x 8192: 0.574 ->
# 0.507-0.516 fp8, 0.643 -> 0.529-0.547 int8). Per-token formats stay capped, heads on N: heads
# on M lost there by 25-100%. resident_per_sm from the sm_90 compile of each row (H200: 64K
# registers, 228 KB shared memory per SM): bf16 168 registers and 74 KB -> 3; static fp8/int8
# 167 registers -> 3; the others are capped at 128 registers with <= 25 KB of shared memory -> 4.
TUNED = {
    ("float", False): Tuned(128, 3, False, False, False, False, None, 3),  # bf16/fp16: 0.50 ms
    ("fp8", False): Tuned(64, 3, False, True, False, False, None, 3, True),  # 0.524 -> 0.392 -> 0.353-0.359 ms
    ("int8", False): Tuned(64, 3, False, True, False, False, None, 3, True, False, True),  # 0.464 -> 0.443 -> 0.370-0.373
    ("int4", False): Tuned(128, 2, False, False, False, False, 128, 4),  # 0.432 -> 0.296 ms
    ("fp8", True): Tuned(64, 2, False, True, True, False, 128, 4, True, True),  # 0.553 -> 0.421 ms
    ("int8", True): Tuned(64, 2, False, True, True, False, 128, 4, True, True, True),  # 0.691 -> 0.618 -> 0.474 ms
    ("int4", True): Tuned(64, 2, False, True, False, False, 128, 4, True, True),  # asym 0.752 -> 0.479 -> 0.451
}


def tuned_for(kf: KernelFormat) -> Tuned:
    kind = "int4" if kf.kind == KIND_INT4 else "int8" if kf.kind == KIND_INT8 else "fp8" if kf.fp8 else "float"
    return TUNED[(kind, kf.scale_mode == SCALE_TOKEN)]


def probability_dtype(cache: LayerCache, q_dtype: torch.dtype) -> torch.dtype:
    """The dtype the default launch rounds softmax probabilities to before p . V (on the GPU)."""
    return torch.float16 if tuned_for(kernel_format(cache)).dot_fp16 else q_dtype
