"""The decode step's small ops as one kernel each: residual add + RMSNorm, RoPE on q and k, SwiGLU.

In an eager or captured decode step of an 8B model these are ~10 torch kernels per layer (casts,
a square, a mean, rsqrt, two multiplies, the residual add; RoPE's gathers, halves, negation, cat,
multiplies and add; silu and a multiply), each a full read and write of a small activation: at
batch 1 every one costs a launch's latency, not bandwidth. The fused kernels give the bits of the
ops they replace, so a step through them produces the tokens of the unfused step:

* `add_rms_norm(h, delta, w, eps)`: h + delta rounded once to the model dtype (torch's add), then
  RMSNorm, rounded to the dtype and multiplied by the weight (model._rms_norm's order); without delta
  just the norm. A reduction's order decides its last bit and no Triton kernel can follow torch's
  mean, so on CUDA the unfused model runs this kernel too (`rms_norm`, model._rms_norm): one
  reduction serves both. Its sum of squares runs in fp64 (squares of 16-/32-bit floats are exact
  there), the inverse root in fp64, rounded once to fp32: closer to the exact norm than torch's fp32
  mean and rsqrt, and the same bits however the GPU orders the sum's additions.
* `rope_qk(qkv, table_cos, table_sin, positions, heads, kv_heads)`: q and k out of the fused QKV
  matmul's rows, rotated (HF's rotate-half) and written contiguous, the cos/sin rows read from the
  fp32 tables and rounded to the dtype as Rotary.cos_sin does; each product and the sum rounded as
  torch rounds them: bit-identical to rope.apply_rotary.
* `swiglu(gate_up)`: silu(gate) = g / (1 + exp(-g)) in fp32 (torch's CUDA kernel: the accurate expf,
  an IEEE division), rounded to the dtype, times up, rounded (F.silu(gate) * up).

Every kernel is compiled without FMA contraction (`enable_fp_fusion=False`): torch rounds each
elementwise product and sum, and a fused multiply-add skips the rounding between them (the GPU
narrows fp32 ops on fp16 operands to fp16 ones, which it then fused: fp16 RoPE lost bits that way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra import libdevice

# torch rounds every elementwise op: no multiply-add contraction in these kernels (the module docstring)
EXACT = {"enable_fp_fusion": False}


@triton.jit
def _round(x, DT: tl.constexpr):
    """fp32 x rounded to nearest even in DT. bf16 through its bits: the interpreter truncates fp32 -> bf16
    casts, and the kernels must give the GPU's (and torch's) roundings under it too. NaN stays NaN."""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rounded)
    else:
        return x.to(DT)


@triton.jit
def _add_rms_norm_kernel(H, DELTA, W, OUT_H, OUT_N, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_DELTA: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(H + row * N + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(DELTA + row * N + offs, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + d.to(tl.float32), OUT_H.dtype.element_ty)
        tl.store(OUT_H + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    xd = xf.to(tl.float64)
    # fp64 division and root are IEEE on the GPU (only fp32 ones take the approximate instructions)
    inv = (1.0 / tl.sqrt(tl.sum(xd * xd, 0) / N + eps)).to(tl.float32)
    normed = _round(xf * inv, OUT_N.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(OUT_N + row * N + offs, _round(w.to(tl.float32) * normed.to(tl.float32), OUT_N.dtype.element_ty),
             mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta) * w) for contiguous h, delta [T, N]; delta None: (h, rms_norm(h) * w)."""
    t, n = h.shape
    out_h = torch.empty_like(h) if delta is not None else h
    out_n = torch.empty_like(h)
    if t:
        # one launch configuration for both variants: the sum's order (and so its bits) is the layout's
        _add_rms_norm_kernel[(t,)](h, delta if delta is not None else h, w, out_h, out_n, eps, N=n,
                                   BLOCK=triton.next_power_of_2(n), HAS_DELTA=delta is not None,
                                   num_warps=4 if n <= 4096 else 8, **EXACT)
    return out_h, out_n


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * w over the last dim of x [..., N]: `add_rms_norm`'s norm, for the unfused model on CUDA."""
    n = x.shape[-1]
    return add_rms_norm(x.reshape(-1, n).contiguous(), None, w, eps)[1].view(x.shape)


@triton.jit
def _rope_kernel(QKV, COS, SIN, POS, Q, K, stride_t, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                 D: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads
    half: tl.constexpr = D // 2
    offs = tl.arange(0, half)
    pos = tl.load(POS + t)
    src = QKV + t * stride_t + head * D
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + half + offs).to(tl.float32)
    dt = Q.dtype.element_ty
    # the table is cat(freqs, freqs): both halves take the same cos/sin
    c = _round(tl.load(COS + pos * D + offs), dt).to(tl.float32)
    s = _round(tl.load(SIN + pos * D + offs), dt).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1); every op rounded to the dtype
    lo = _round(_round(x1 * c, dt).to(tl.float32) + _round(-x2 * s, dt).to(tl.float32), dt)
    hi = _round(_round(x2 * c, dt).to(tl.float32) + _round(x1 * s, dt).to(tl.float32), dt)
    if head < HEADS:
        dst = Q + (t * HEADS + head) * D
    else:
        dst = K + (t * KV_HEADS + head - HEADS) * D
    tl.store(dst + offs, lo)
    tl.store(dst + half + offs, hi)


def rope_qk(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
            heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, D], k [T, kv_heads, D] (contiguous, rotated) from qkv [T, (heads + 2 kv_heads) D];
    cos/sin tables [positions, D] fp32 (rope.Rotary.table), positions [T] int64."""
    t = qkv.shape[0]
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_kernel[(t, heads + kv_heads)](qkv, cos_table, sin_table, positions, q, k, qkv.stride(0),
                                            HEADS=heads, KV_HEADS=kv_heads, D=head_dim, num_warps=1, **EXACT)
    return q, k


@triton.jit
def _swiglu_kernel(GU, OUT, N: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(GU + row * 2 * N + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * N + N + offs, mask=mask, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    # torch's silu: x / (1 + expf(-x)), the accurate expf (libdevice's; tl.exp is the approximate ex2) and an
    # IEEE division; the interpreter has no libdevice and takes numpy's exp
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    act = _round(tl.math.div_rn(g, 1.0 + e), dt).to(tl.float32)
    tl.store(OUT + row * N + offs, _round(act * u, dt), mask=mask)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2N] (gate first, as model.LayerWeights.gate_up is stacked)."""
    t, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if t:
        _swiglu_kernel[(t, triton.cdiv(n, block))](gate_up, out, N=n, BLOCK=block, LIBDEVICE=not knobs.runtime.interpret,
                                                   num_warps=4, **EXACT)
    return out
