"""Skinny matmuls (decode: M <= 16 rows) as a Triton GEMV, where measured data says it beats cuBLAS.

A decode step's matmuls read each weight once for a handful of rows: their time is the weight's bytes
over the achieved bandwidth. cuBLAS picks its kernel by shape and can leave bandwidth unused at M <= 16
on some shapes; `gemv` streams the weight in [BLOCK_N, BLOCK_K] tiles, one program per BLOCK_N output
features, x padded to 16 rows for the tensor cores (the padding's products are zeros), fp32 accumulation.

Which one runs is data, not a guess: `tuned/gemv_<gpu>.json` lists per weight shape (n, k) the largest M
where the GEMV measured faster (benchmarks/step_profile.py --gemm-sweep writes the file); a shape not in
it, or a GPU without the file, runs cuBLAS (`batch_invariant.fast_linear`). The two sum in different
orders, so switching a shape changes its outputs' last bits (the batch-invariant mode never uses this).
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import torch
import triton
import triton.language as tl

from ..batch_invariant import fast_linear
from .tuned_file import device_of, tuned_file_name

MAX_M = 16  # rows a GEMV program carries (the tensor cores' smallest M)


@triton.jit
def _gemv_kernel(X, W, OUT, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k[None, :] < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=(offs_m[:, None] < M) & kmask, other=0.0)
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=(offs_n[:, None] < N) & kmask, other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong (runtime/kernels/codes.py): fp32 operands there
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
    tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 16, block_k: int = 256) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype, for M <= MAX_M."""
    m, k = x.shape
    n, kw = w.shape
    if kw != k or not 1 <= m <= MAX_M or x.dtype != w.dtype:
        raise ValueError(f"gemv takes x [1..{MAX_M}, K] and w [N, K] of one dtype, got {tuple(x.shape)} {x.dtype} "
                         f"and {tuple(w.shape)} {w.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    interpret = device_of(x.device).interpret
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=MAX_M, BLOCK_N=block_n,
        BLOCK_K=block_k, UPCAST=interpret or x.dtype == torch.float32, num_warps=4, num_stages=4)
    return out


@functools.cache
def gemv_shapes(device_name: str) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(n, k) -> (the largest M at which the GEMV beat cuBLAS on this GPU, its block_n, block_k); {} without a
    tuned file."""
    path = resources.files(__package__) / "tuned" / f"gemv_{tuned_file_name(device_name)}.json"
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text())["shapes"]
    return {(int(r["n"]), int(r["k"])): (int(r["max_m"]), int(r["block_n"]), int(r["block_k"])) for r in rows}


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T by the GEMV where the tuned data says it is faster at this M, else cuBLAS."""
    m = x.shape[0]
    if x.is_cuda and m <= MAX_M:
        tuned = gemv_shapes(_device_name(x.device.index or 0)).get(tuple(w.shape))
        if tuned is not None and m <= tuned[0]:
            return gemv(x, w, block_n=tuned[1], block_k=tuned[2])
    return fast_linear(x, w)
