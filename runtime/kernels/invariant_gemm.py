"""The batch-invariant mode's matmul on CUDA: a row's bits never depend on the other rows of the batch.

cuBLAS picks its kernel (tile shape, split-K, stream-K) by the problem's shape, so the same row summed
beside 7 or 63 others can come out with other last bits; a quantized KV cache turns those into other codes
and greedy decoding into other text (docs/numerics.md). This GEMM has no split-K and a fixed K loop: every
output element is the fp32 sum of its K products in BLOCK_K steps from k = 0, and the tensor cores compute
each element of a tile the same way whatever the other rows hold (padding rows load zeros). M is not
specialized on (`do_not_specialize`), so one compiled kernel serves every row count of a tile config. The
same idea as Thinking Machines' batch_invariant_ops and vLLM's batch-invariant mode.

Config: the one config (`gemm_config`) serves every row count. At decode sizes (M <= a few hundred) an 8B
model's matmuls read their weight once a step, so the time is the weight's bytes over the bandwidth the grid
reaches: BLOCK_N is the largest of 128 / 64 / 32 that still gives every SM of an H200 two programs at one row
tile, BLOCK_K 128 in 4 pipeline stages keeps enough loads in flight per program.

On the H200 (sm_90, bf16 / fp16 operands on wgmma) the tile is chosen by M after all (`rows_config`): there a
tile's element is its K products summed into the fp32 accumulator 16 at a time from k = 0 whatever the tile's
rows, columns, BLOCK_K, warps or stages, so every tile config gives every row the same bits. Measured, not
assumed: twelve configs (64 / 128 / 256 rows, 32-256 columns, BLOCK_K 64 / 128, 4 / 8 warps, 3 / 4 stages) gave
bit-identical products at Llama-3-8B's and SmolLM2's shapes for 1-400 rows, at any row offset
(benchmarks/results/invariant_gemm.md), and tests/test_kernel_invariant.py checks rows across the M buckets on
the GPU machine. Large tiles then pay back at many rows: 1.4-2.1x the one config's speed at Llama-3-8B's shapes
at 179-337 rows (0.5-0.8x cuBLAS there, 0.8-1.1x at up to 64 rows). The interpreter (numpy's BLAS rounds by
the tile's shape) and other GPUs keep the one config.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .tuned_file import device_of

BLOCK_M = 64  # rows a program of the one config: the smallest wgmma M
_SMS = 132  # the H200's SM count: the config rule's constant (a config must not vary with the machine's load)


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@functools.cache
def gemm_config(n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """The one tile config of a weight [n, k] of `dtype` (see the module docstring)."""
    fp32 = dtype == torch.float32
    # fp32 tiles hold twice the bytes: 128 columns spill registers on sm_90 (tests/helpers_invariant_compile.py)
    block_n = next((b for b in ((64,) if fp32 else (128, 64)) if triton.cdiv(n, b) >= 2 * _SMS), 32)
    block_k = 64 if fp32 else 128
    return GemmConfig(block_n, _fit_k(block_k, k), 4, 3 if fp32 else 4)


def _fit_k(block_k: int, k: int) -> int:
    """block_k, no wider than k needs (a power of two, >= 16: tl.dot's smallest K)."""
    return min(block_k, max(16, triton.next_power_of_2(k)))


# (block_m, config) in the order `rows_config` tries them: the larger tiles first
_WIDE = (256, GemmConfig(128, 64, 8, 3))
_BIG = (128, GemmConfig(256, 64, 8, 4))
_MID = (128, GemmConfig(128, 64, 8, 4))
_SMALL = tuple((64, GemmConfig(n, 128, 4, 4)) for n in (128, 64, 32))


@functools.cache
def rows_config(n: int, k: int, m: int) -> tuple[int, GemmConfig]:
    """(BLOCK_M, config) of a bf16 / fp16 product of m rows with a weight [n, k] on sm_90, where every config gives
    the same bits (module docstring): the largest tile whose rows the product fills (64-row tiles up to 64 rows,
    256-row ones only from 129 to 256 rows) and whose grid still gives half the H200's SMs a program; else the
    narrowest tile. Fitted to the timings of benchmarks/results/invariant_gemm.md."""
    order = _SMALL if m <= 64 else ((_BIG, _MID) + _SMALL if m <= 128 or m > 256 else (_WIDE, _BIG, _MID) + _SMALL)
    for block_m, cfg in order:
        if triton.cdiv(n, cfg.block_n) * triton.cdiv(m, block_m) >= _SMS // 2:
            break
    return block_m, dataclasses.replace(cfg, block_k=_fit_k(cfg.block_k, k))


@functools.cache
def _tiles_by_rows(device: torch.device) -> bool:
    """Whether products on `device` take `rows_config`: compiled for sm_90 (not the interpreter)."""
    dev = device_of(device)
    return dev.cuda and not dev.interpret and dev.capability == 9


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(X, W, OUT, M, stride_xm, stride_wn, stride_om, N: tl.constexpr, K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                   IEEE: tl.constexpr):
    pid_n = tl.program_id(0)  # programs along N first: the row tiles of one weight tile run together
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):  # k from 0 up in BLOCK_K steps: the one summation order
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k[None, :] < K
        x = tl.load(x_rows + offs_k[None, :], mask=mmask[:, None] & kmask, other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & kmask, other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong (runtime/kernels/codes.py): fp32 operands there
            x, w = x.to(tl.float32), w.to(tl.float32)
        if IEEE:  # fp32 operands: full fp32 products, never TF32
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out = OUT + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Batch-invariant x [..., K] @ w [N, K]^T -> [..., N] in x's dtype (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if w.is_mkldnn:  # a CPU weight laid out for oneDNN (batch_invariant.pack_weight): the interpreter reads plain ones
        w = w.to_dense()
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or x.dtype != w.dtype:
        raise ValueError(f"linear takes x [..., K] and w [N, K] of one dtype, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    if w.dtype in (torch.bfloat16, torch.float16) and _tiles_by_rows(x.device):
        block_m, cfg = rows_config(n, k, x2.shape[0])
        return launch(x2, w, cfg, block_m).view(*lead, n)
    return launch(x2, w, gemm_config(n, k, w.dtype)).view(*lead, n)


def launch(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig, block_m: int = BLOCK_M) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ w [N, K]^T under `cfg` in tiles of `block_m` rows (benchmarks compare
    configs through this; the mode runs `linear`, whose config is `gemm_config`'s or `rows_config`'s)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        interpret = device_of(x.device).interpret
        _matmul_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))](
            x, w, out, m, x.stride(0), w.stride(0), out.stride(0), N=n, K=k, BLOCK_M=block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=interpret and x.dtype != torch.float32,
            IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
