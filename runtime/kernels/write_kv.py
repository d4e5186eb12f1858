"""Fused quantize-on-write: a step's new K and V go into the paged cache.

One program handles BLOCK_T tokens of one KV head for both K and V: it loads
the rows, computes the per-token scale (and zero point) when the format is
dynamic, quantizes, and stores the bytes at each token's slot
(`block_id * block_size + offset`). Every rounding decision is the one
`runtime/kv_quant.py` makes, so the bytes equal `kv_quant.quantize`'s:

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

int4 takes a layout of its own by default (`write_rows.py`; `WritePlan.lanes` = N): whole rows over N lanes, the clamp in front of the division, one
fma correction where the scale has at most 11 significant bits, word loads and stores, and for
per-token fp16 scales bf16x2 row reductions (`WritePlan.packed`). Same bytes; on the tile below, int4's
per-row reductions and scale arithmetic cost more instructions than its few bytes can hide (78% of
copy bandwidth against 88-96%). The int8 and fp8 per-token formats take the same rows from bf16 input with
fp16 scales on the GPU (`WritePlan.lanes` with `packed`): int8 87% -> 94% of copy, asymmetric 80% -> 92%; fp8
(the tile's own quotient and conversion a value, in the rows' layout) from the tile's 78-83%.

Negative slots are skipped (padding tokens), as in vLLM.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import codes
from .exact_round import _clamp_round, _fp8_byte, _quotient, _reciprocal, _rne
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
    if KIND == codes.INT4:
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
    if SCALE_MODE == codes.NO_SCALE:
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
    if SCALE_MODE == codes.PER_TOKEN:
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
        # clamped like kv_quant.dynamic_scales: never zero, never inf (a huge token saturates)
        s = _clamp_round(s, SCALE_DT, True)
        tl.store(scale_ptr + meta_off, s.to(scale_ptr.dtype.element_ty), mask=mask_t)
        if ASYM:
            tl.store(zero_ptr + meta_off, z.to(zero_ptr.dtype.element_ty), mask=mask_t)
            xa = xa - z[:, None]
            xb = xb - z[:, None]
        s, y, k = _reciprocal(s, SCALE_DT != codes.SCALE_FP16)
        s, y = s[:, None], y[:, None]
        if SCALE_DT != codes.SCALE_FP16:
            k = k[:, None]
    else:
        if SCALE_MODE == codes.PER_HEAD:
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
    if KIND != codes.INT4:
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
    if KIND == codes.FLOAT:
        out = _fp8_byte(ya, FP8, QMIN, QMAX)
    elif KIND == codes.INT8:
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


# ints that change step to step add no compiled variants while serving (runtime/warmup.py)
@triton.jit(do_not_specialize=["num_tokens"])
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
        if KIND == codes.FLOAT:
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
