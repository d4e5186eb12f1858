"""Fused quantize-on-write: a step's new K and V go into the paged cache.

One program handles BLOCK_T tokens of one KV head for both K and V: it loads
the rows, computes the per-token scale (and zero point) when the format is
dynamic, quantizes, and stores the bytes at each token's slot
(`block_id * block_size + offset`). Every rounding decision is the one
`runtime/kv_format.py` makes, so the bytes equal `kv_format.quantize`'s:

* scales: s = amax / qmax in fp32 (IEEE division, `div_rn`), clamped to the
  scale dtype's [smallest normal, largest finite], then rounded *up* to the
  scale dtype; asymmetric zero points (the row minimum, clamped to the finite
  range) are rounded *down*. Rounding is
  done by comparing the cast with the fp32 value and stepping one ulp through
  the bit pattern, which is right whichever way the cast itself rounds.
* values: (x - zero) / s with `div_rn`, NaN -> 0, clamp to [qmin, qmax], then
  round half to even (integers: the 1.5 * 2**23 trick; fp8: an integer-only
  encoder). The fp8 encoder exists because float->fp8 casts differ between
  back ends (the interpreter misrounds at binade edges, torch gives NaN out of
  range, Triton on GPU saturates); the integer encoder is one definition that
  is exact everywhere. On the GPU the value is already clamped and NaN-free, so
  the hardware's saturating round-to-nearest-even conversion gives the same
  byte in one instruction per two values; the GPU tests check that byte for byte.

On the GPU (FAST) two more exact shortcuts replace instruction-heavy steps, because
the write is compute-bound otherwise (a `div.rn` is ~11 issued instructions per
value, with its slow-path branch): the division by a row's (or the tensor's) scale
uses its correctly rounded reciprocal and two fma corrections (`_quotient`), and
integers round with one `cvt.rni` whose NaN -> 0 and saturation the integer clamp
finishes. The interpreter has no fused multiply-add, so it keeps `div_rn`.

int4 takes a layout of its own by default (`write_rows.py`, `_int4_defaults`;
`write_kv_launch(int4_lanes=N)`): whole rows over N lanes, the clamp in front of the division, one
fma correction where the scale has at most 11 significant bits, word loads and stores, and for
per-token fp16 scales bf16x2 row reductions (`int4_packed`). Same bytes; on the tile below, int4's
per-row reductions and scale arithmetic cost more instructions than its few bytes can hide (78% of
copy bandwidth against 88-96%). The int8 and fp8 per-token formats take the same rows from bf16 input with
fp16 scales on the GPU (`byte_rows`, `BYTE_ROWS`): int8 87% -> 94% of copy, asymmetric 80% -> 92%; fp8
(the tile's own quotient and conversion a value, in the rows' layout) from the tile's 78-83%.

Negative slots are skipped (padding tokens), as in vLLM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..kv_cache import LayerCache
from .exact_round import _clamp_round, _fp8_byte, _quotient, _reciprocal, _rne
from .formats import (
    FP8_HARDWARE,
    FP8_NONE,
    KIND_INT4,
    KIND_INT8,
    SCALE_NONE,
    SCALE_TOKEN,
    check_device,
    kernel_format,
    scale_tensors,
)
from .write_rows import _rows_load, _rows_store, _rows_store_fp8_words, _rows_store_words, _rows_words


@triton.jit
def _to_int(y, QMIN: tl.constexpr, QMAX: tl.constexpr, FAST: tl.constexpr):
    """Round half to even into [QMIN, QMAX] as int32; NaN -> 0."""
    if FAST:  # cvt.rni: NaN -> 0 and saturates, so the clamp can follow in integers
        QMIN_I: tl.constexpr = int(QMIN)
        QMAX_I: tl.constexpr = int(QMAX)
        n = tl.minimum(tl.maximum(libdevice.float2int_rn(y), QMIN_I), QMAX_I)
    else:
        n = _rne(tl.minimum(tl.maximum(tl.where(y != y, 0.0, y), QMIN), QMAX)).to(tl.int32)
    return n


@triton.jit
def _load_rows(x_ptr, t, mask_t, head, offs_d, stride_xt, stride_xh, HEAD_DIM: tl.constexpr, KIND: tl.constexpr):
    """Rows [BLOCK_T, BLOCK_D] of x in fp32, and their mask; for int4 the even and odd columns."""
    row = x_ptr + t[:, None] * stride_xt + head * stride_xh
    if KIND == 2:
        # int4 packs columns 2j and 2j+1: load whole rows (contiguous, vectorized) and split them
        BLOCK_T: tl.constexpr = mask_t.shape[0]
        BLOCK_D: tl.constexpr = offs_d.shape[0]
        cols = tl.arange(0, 2 * BLOCK_D)
        x = tl.load(row + cols[None, :], mask=mask_t[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)
        xa, xb = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_T, BLOCK_D, 2)))
        dmask = offs_d < HEAD_DIM // 2
    else:
        dmask = offs_d < HEAD_DIM
        xa = tl.load(row + offs_d[None, :], mask=mask_t[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        xb = xa
    return xa, xb, mask_t[:, None] & dmask[None, :]


@triton.jit
def _store_rows(
    xa, xb, m2, cache_ptr, scale_ptr, zero_ptr, mask_t, dst_base, meta_off, head, offs_d,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, ASYM: tl.constexpr,
    FP8: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, SCALE_DT: tl.constexpr,
    FULL_D: tl.constexpr, FAST: tl.constexpr,
):
    if SCALE_MODE == 0:
        # unquantized: the launcher has already matched x's dtype to the cache's
        tl.store(cache_ptr + dst_base[:, None] + offs_d[None, :], xa.to(cache_ptr.dtype.element_ty), mask=m2)
    else:
        _quantize_rows(xa, xb, m2, mask_t, cache_ptr, scale_ptr, zero_ptr, dst_base, meta_off, head, offs_d,
                       KIND, SCALE_MODE, ASYM, FP8, QMIN, QMAX, SCALE_DT, FULL_D, FAST)


@triton.jit
def _quantize_rows(
    xa, xb, m2, mask_t, cache_ptr, scale_ptr, zero_ptr, dst_base, meta_off, head, offs_d,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, ASYM: tl.constexpr,
    FP8: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, SCALE_DT: tl.constexpr,
    FULL_D: tl.constexpr, FAST: tl.constexpr,
):
    if SCALE_MODE == 3:
        if ASYM:
            # int4's two column halves are combined before reducing: one cross-thread reduction
            # (shuffles) instead of two (xa is xb for the other kinds)
            if FULL_D:  # masked rows load as 0 and store nothing: only padding columns need excluding
                lo = tl.min(_halves(xa, xb, KIND, False), 1)
                hi = tl.max(_halves(xa, xb, KIND, True), 1)
            else:
                lo = tl.min(_halves(tl.where(m2, xa, float("inf")), tl.where(m2, xb, float("inf")), KIND, False), 1)
                hi = tl.max(_halves(tl.where(m2, xa, -float("inf")), tl.where(m2, xb, -float("inf")), KIND, True), 1)
            z = _clamp_round(lo, SCALE_DT, False)
            s = tl.math.div_rn(hi - z, tl.full(z.shape, QMAX, tl.float32))
        else:
            amax = tl.max(_halves(tl.abs(xa), tl.abs(xb), KIND, True), 1)
            s = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
        # clamped like kv_format.dynamic_scales: never zero, never inf (a huge token saturates)
        s = _clamp_round(s, SCALE_DT, True)
        tl.store(scale_ptr + meta_off, s.to(scale_ptr.dtype.element_ty), mask=mask_t)
        if ASYM:
            tl.store(zero_ptr + meta_off, z.to(zero_ptr.dtype.element_ty), mask=mask_t)
            xa = xa - z[:, None]
            xb = xb - z[:, None]
        s, y, k = _reciprocal(s, SCALE_DT != 0)
        s, y = s[:, None], y[:, None]
        if SCALE_DT != 0:
            k = k[:, None]
    else:
        if SCALE_MODE == 2:
            s = tl.load(scale_ptr + head)
        else:
            s = tl.load(scale_ptr)
        s, y, k = _reciprocal(s, True)
    out = _encode(xa, xb, s, y, k, KIND, ASYM, FP8, QMIN, QMAX, FAST)
    tl.store(cache_ptr + dst_base[:, None] + offs_d[None, :], out, mask=m2)


@triton.jit
def _halves(xa, xb, KIND: tl.constexpr, MAX: tl.constexpr):
    """int4's two column halves combined elementwise (max or min) for one row reduction; the
    other kinds have one half (xa is xb)."""
    if KIND != 2:
        out = xa
    elif MAX:
        out = tl.maximum(xa, xb)
    else:
        out = tl.minimum(xa, xb)
    return out


@triton.jit
def _encode(xa, xb, s, y, k, KIND: tl.constexpr, ASYM: tl.constexpr, FP8: tl.constexpr, QMIN: tl.constexpr,
            QMAX: tl.constexpr, FAST: tl.constexpr):
    """Values (zero point already subtracted) / s -> the stored bytes (int4: xa low nibble, xb high)."""
    ya = _quotient(xa, s, y, k, FAST)
    if KIND == 0:
        out = _fp8_byte(ya, FP8, QMIN, QMAX)
    elif KIND == 1:
        if ASYM:
            out = _to_int(ya, QMIN, QMAX, FAST).to(tl.uint8)
        else:
            out = _to_int(ya, QMIN, QMAX, FAST).to(tl.int8)
    else:
        na = _to_int(ya, QMIN, QMAX, FAST)
        nb = _to_int(_quotient(xb, s, y, k, FAST), QMIN, QMAX, FAST)
        if not ASYM:
            na += 8
            nb += 8
        out = (na | (nb << 4)).to(tl.uint8)
    return out


@triton.jit
def _write_kv_kernel(
    K, V, KC, VC, KS, VS, KZ, VZ, SLOTS,
    num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_ct,
    stride_mb, stride_mh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, ASYM: tl.constexpr, FP8: tl.constexpr,
    QMIN: tl.constexpr, QMAX: tl.constexpr, SCALE_DT: tl.constexpr, FULL_D: tl.constexpr, FAST: tl.constexpr,
    LANES: tl.constexpr = 0, PACKED: tl.constexpr = False,
):
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(SLOTS + t, mask=t < num_tokens, other=-1)
    mask_t = slot >= 0
    slot = tl.where(mask_t, slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    dst = tl.multiple_of(blk * stride_cb + head * stride_ch + off * stride_ct, 16)
    meta = blk * stride_mb + head * stride_mh + off
    if LANES and PACKED:  # ... with bf16x2 instructions (`_rows_store_words`)
        C: tl.constexpr = HEAD_DIM // (8 * LANES)
        kw = _rows_words(K, t, mask_t, head, stride_kt, stride_kh, C, LANES)
        vw = _rows_words(V, t, mask_t, head, stride_vt, stride_vh, C, LANES)
        if KIND == 0:
            _rows_store_fp8_words(kw, KC, KS, mask_t, dst, meta, FP8, QMIN, QMAX)
            _rows_store_fp8_words(vw, VC, VS, mask_t, dst, meta, FP8, QMIN, QMAX)
        else:
            _rows_store_words(kw, KC, KS, KZ, mask_t, dst, meta, ASYM, QMAX, KIND)
            _rows_store_words(vw, VC, VS, VZ, mask_t, dst, meta, ASYM, QMAX, KIND)
    elif LANES:  # int4 with whole rows over LANES lanes (`_rows_load`)
        # both loads before any store (as below)
        C: tl.constexpr = HEAD_DIM // (8 * LANES)
        ke, ko = _rows_load(K, t, mask_t, head, stride_kt, stride_kh, C, LANES)
        ve, vo = _rows_load(V, t, mask_t, head, stride_vt, stride_vh, C, LANES)
        _rows_store(ke, ko, KC, KS, KZ, mask_t, dst, meta, head, SCALE_MODE, ASYM, QMAX, SCALE_DT, FAST)
        _rows_store(ve, vo, VC, VS, VZ, mask_t, dst, meta, head, SCALE_MODE, ASYM, QMAX, SCALE_DT, FAST)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        # both loads before any store: the compiler may not move a load across a store that could
        # alias it, and two loads in flight halve the latency each program waits on
        ka, kb, m2 = _load_rows(K, t, mask_t, head, offs_d, stride_kt, stride_kh, HEAD_DIM, KIND)
        va, vb, _ = _load_rows(V, t, mask_t, head, offs_d, stride_vt, stride_vh, HEAD_DIM, KIND)
        _store_rows(ka, kb, m2, KC, KS, KZ, mask_t, dst, meta, head, offs_d,
                    KIND, SCALE_MODE, ASYM, FP8, QMIN, QMAX, SCALE_DT, FULL_D, FAST)
        _store_rows(va, vb, m2, VC, VS, VZ, mask_t, dst, meta, head, offs_d,
                    KIND, SCALE_MODE, ASYM, FP8, QMIN, QMAX, SCALE_DT, FULL_D, FAST)


def write_kv_launch(
    cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    block_t: int | None = None, num_warps: int | None = None, fast: bool | None = None,
    int4_lanes: int | None = None, int4_packed: bool | None = None, byte_rows: int | None = None,
) -> None:
    """Validate, then launch one program per (BLOCK_T tokens, KV head).

    fast: the GPU's exact shortcuts (hardware fp8 conversion, division through the
    reciprocal, `cvt.rni` rounding; same bytes); default on CUDA, impossible in the interpreter.
    int4_lanes: int4 only (other formats ignore it), 2/4/8: whole rows over that many lanes, the
    clamp before the division and 32-bit word stores (`_rows_load`, `_rows_store`; same bytes);
    0, or a head_dim that is not a power of two >= 8 * int4_lanes: the [tokens, head_dim] tile.
    int4_packed: with int4_lanes, fast, bf16 k / v and per-token fp16 scales (else ignored): the row
    min / max and the symmetric clamp on bf16 pairs (`_rows_store_words`; same bytes).
    byte_rows: int8 and fp8 per-token formats with fp16 scales, fast, bf16 k / v (else ignored), 2/4/8:
    int4_packed's rows over that many lanes, stored as bytes (`_rows_bytes_store`, `_rows_store_fp8_words`;
    same bytes); 0: the tile.
    Options left at None take the measured best (`_int4_defaults`, BYTE_ROWS; the tile path: 2 warps)."""
    kf = kernel_format(cache)
    check_device(cache.k, k, v, slot_mapping)
    nb, heads, bs, _ = cache.k.shape
    if k.dim() != 3 or k.shape != v.shape or k.shape[1] != heads or k.shape[2] != kf.head_dim:
        raise ValueError(
            f"k and v must both be [tokens, {heads}, {kf.head_dim}] for this cache, "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0] or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if k.dtype not in (torch.float16, torch.bfloat16, torch.float32) or v.dtype != k.dtype:
        raise ValueError(f"k and v must share a float dtype (fp16/bf16/fp32), got {k.dtype} and {v.dtype}")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    if kf.scale_mode == SCALE_NONE and k.dtype != cache.k.dtype:
        # A float->float cast is torch's job (the interpreter truncates bf16 casts).
        k, v = k.to(cache.k.dtype), v.to(cache.k.dtype)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slot_mapping = slot_mapping.contiguous()
    # fp8 pages are written as bytes by the integer encoder.
    kc, vc = (cache.k.view(torch.uint8), cache.v.view(torch.uint8)) if kf.fp8 != FP8_NONE else (cache.k, cache.v)
    ks, vs, kz, vz = scale_tensors(cache, kc)
    stored = cache.k.shape[-1]
    fast = cache.k.device.type == "cuda" if fast is None else fast
    # on the GPU the hardware conversion (one instruction per two values) replaces the encoder
    fp8 = FP8_HARDWARE[kf.fp8] if kf.fp8 != FP8_NONE and fast else kf.fp8
    if block_t is None:
        block_t = 16 if num_tokens >= 16 * heads else 4
    default_lanes, default_packed = _int4_defaults(kf)
    int4_lanes = default_lanes if int4_lanes is None else int4_lanes
    int4_packed = default_packed if int4_packed is None else int4_packed
    if int4_lanes not in (0, 2, 4, 8, 16):
        raise ValueError(f"int4_lanes must be 0, 2, 4, 8 or 16, got {int4_lanes}")
    # rows over N lanes need head_dim a power of two of >= 8 columns a lane
    rows_fit = lambda n: kf.head_dim & (kf.head_dim - 1) == 0 and kf.head_dim >= 8 * n  # noqa: E731
    lanes = int4_lanes if kf.kind == KIND_INT4 and rows_fit(int4_lanes) else 0
    words_ok = fast and k.dtype == torch.bfloat16 and kf.scale_mode == SCALE_TOKEN and kf.scale_dtype == 0
    packed = bool(int4_packed and lanes and words_ok)
    byte_rows = BYTE_ROWS if byte_rows is None else byte_rows
    if byte_rows not in (0, 2, 4, 8):
        raise ValueError(f"byte_rows must be 0, 2, 4 or 8, got {byte_rows}")
    if (kf.kind == KIND_INT8 or kf.fp8 != FP8_NONE) and byte_rows and words_ok and rows_fit(byte_rows):
        lanes, packed = byte_rows, True
    if num_warps is None:  # a row per `lanes` threads: 8 lanes x 16 tokens fill 4 warps; fewer tokens, fewer warps
        num_warps = max(1, min(4 if lanes == 8 else 2, lanes * block_t // 32)) if lanes else 2
    grid = (triton.cdiv(num_tokens, block_t), heads)
    _write_kv_kernel[grid](
        k, v, kc, vc, ks, vs, kz, vz, slot_mapping,
        num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        heads * bs, bs,
        BLOCK_SIZE=bs, HEAD_DIM=kf.head_dim, BLOCK_D=triton.next_power_of_2(stored), BLOCK_T=block_t,
        KIND=kf.kind, SCALE_MODE=kf.scale_mode, ASYM=kf.asym, FP8=fp8,
        QMIN=kf.qmin, QMAX=kf.qmax, SCALE_DT=kf.scale_dtype,
        FULL_D=triton.next_power_of_2(stored) == stored, FAST=fast, LANES=lanes, PACKED=packed,
        num_warps=num_warps,
    )


# int8 and fp8 per-token (fp16 scales, bf16 input, GPU): rows over this many lanes (`write_kv_launch(byte_rows=)`).
# H200, 16 x 32768 written (`results/write_variants_round16_int8_rows.jsonl`): % of copy, tile / 2 / 4 / 8
# lanes: int8 symmetric 87 / 56 / 94 / 94, asymmetric 80 / 63 / 92 / 91 (32 tokens x 4 warps at 4 lanes: the same)
BYTE_ROWS = 4


def _int4_defaults(kf) -> tuple[int, bool]:
    """(int4_lanes, int4_packed) measured fastest on the H200, 16 x 32768 written, % of the same run's
    copy (`results/write_variants_round14.jsonl`): static scales 8 lanes x 16 tokens x 4 warps, 78 -> 88%;
    per-token 4 lanes, packed, 68 -> 96% (asymmetric 58 -> 93%). Other formats: the tile path."""
    if kf.kind != KIND_INT4:
        return 0, False
    return (4, True) if kf.scale_mode == SCALE_TOKEN else (8, False)


def write_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize k, v [T, kv_heads, head_dim] (after RoPE) into `cache` at `slot_mapping` [T] int64."""
    write_kv_launch(cache, k, v, slot_mapping)

