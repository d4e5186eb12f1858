"""Cross-compile the batch-invariant GEMM (runtime/kernels/invariant_gemm.py) for sm_90 at Llama-3-8B's and
SmolLM2's weight shapes, bf16 and fp32, in the one config and in the tiles `rows_config` picks by row count, and
print one JSON line each (registers, spill stack, shared memory).
Run without TRITON_INTERPRET (`python -m tests.helpers_invariant_compile`; tests/test_kernel_invariant.py runs it
in a subprocess)."""

from __future__ import annotations

import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from runtime.kernels import invariant_gemm
from tests.helpers_mixed_compile import resources

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (128, 128), (960, 576),
          (49152, 576)]
FP32_SHAPES = [(4096, 4096), (128256, 4096)]  # an fp32 engine's (parity runs): the narrow and the wide tile
DTYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}


ROWS = (1, 100, 200, 300)  # one M in each of `rows_config`'s buckets


def build(n: int, k: int, dtype: torch.dtype, block_m: int = invariant_gemm.BLOCK_M, cfg=None) -> dict:
    cfg = cfg or invariant_gemm.gemm_config(n, k, dtype)
    fn = invariant_gemm._matmul_kernel
    consts = dict(N=n, K=k, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=False,
                  IEEE=dtype == torch.float32)
    ptr = DTYPES[dtype]
    names = fn.arg_names
    sig = {a: ptr if a in ("X", "W", "OUT") else "constexpr" if a in consts else "i32" for a in names}
    aligned = [a for a in names if a in ("X", "W", "OUT") or a.startswith("stride_")]
    src = ASTSource(fn, sig, constexprs={(names.index(a),): v for a, v in consts.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return dict(resources(compiled), wgmma="wgmma" in compiled.asm["ptx"])


def main() -> None:
    for n, k in SHAPES:
        for dtype in DTYPES if (n, k) in FP32_SHAPES else (torch.bfloat16,):
            try:
                row = build(n, k, dtype)
            except Exception as e:  # report it as that shape's failure, go on
                row = dict(error=f"{type(e).__name__}: {str(e)[-2000:]}")
            print(json.dumps(dict(shape=[n, k], dtype=str(dtype).replace("torch.", ""), **row)), flush=True)
    # the H200's tiles by row count (bf16), each distinct one once
    tiles = {(n, k, *invariant_gemm.rows_config(n, k, m)) for n, k in SHAPES for m in ROWS}
    for n, k, block_m, cfg in sorted(tiles, key=str):
        try:
            row = build(n, k, torch.bfloat16, block_m, cfg)
        except Exception as e:
            row = dict(error=f"{type(e).__name__}: {str(e)[-2000:]}")
        print(json.dumps(dict(shape=[n, k], dtype="bfloat16", block_m=block_m, block_n=cfg.block_n, **row)), flush=True)


if __name__ == "__main__":
    main()
