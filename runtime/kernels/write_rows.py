"""Quantize-on-write with whole rows over a few lanes: int4 (`WritePlan.lanes` = N), and int8 and
fp8 per-token from bf16 rows (`lanes` with `packed`, through `_rows_store_words`).

The tile path of `write_kv.py` spreads a [tokens, head_dim] tile over the warps as the compiler
likes, so every per-token reduction is a chain of shuffles over 4 rows and the per-row scale
arithmetic repeats per thread. Here a row lives in N lanes (N = 4: 32 values a thread), a row's min
/ max is log2(N) shuffles, and the scale arithmetic runs once per thread. Values are clamped to
B = qmax * s (rounded) before the division, so every quotient is finite and lands in range; bf16
rows load as 32-bit words and widen with one shift or mask a value; eight nibbles (int4) or four
bytes (int8) pack by shifts and adds; stores are 32-bit words. The bytes are `kv_quant.quantize`'s, as on the tile path
(`_rows_int` has the rounding argument).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import codes
from .exact_round import _clamp_round, _corrected, _fp8_byte, _quotient, _reciprocal, _rne


@triton.jit
def _bf16x2_max(a, b):
    """Elementwise max of two words of two bf16 each (max.bf16x2: a NaN half gives the other)."""
    return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bf16x2_min(a, b):
    return tl.inline_asm_elementwise("min.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bf16x2_clamp(w, lo, hi):
    """Words of two bf16 clamped to [lo, hi] (words of two bf16 too), NaN kept (max.NaN / min.NaN)."""
    return tl.inline_asm_elementwise("{ .reg .b32 t; max.NaN.bf16x2 t, $1, $2; min.NaN.bf16x2 $0, t, $3; }",
                                     "=r,r,r,r", [w, lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _words_reduce(w, MAX: tl.constexpr, GROUPED: tl.constexpr = False):
    """Row max (min) of a [G, BLOCK_T, C, 4] tile of bf16 pairs as fp32 [1, BLOCK_T, 1, 1]: the
    in-thread part on the pairs (max.bf16x2 / min.bf16x2, one instruction per two values), then
    the two halves, then the lanes in fp32. NaN halves are skipped, as fp32 max / min skip them.
    GROUPED: each c's 8G columns are a group of their own, [1, BLOCK_T, C, 1] (C not reduced)."""
    if MAX:
        p = tl.reduce(w, 3, _bf16x2_max, keep_dims=True)
        if not GROUPED:
            p = tl.reduce(p, 2, _bf16x2_max, keep_dims=True)
        out = tl.max(tl.maximum(_widen_lo(p), _widen_hi(p)), 0, keep_dims=True)
    else:
        p = tl.reduce(w, 3, _bf16x2_min, keep_dims=True)
        if not GROUPED:
            p = tl.reduce(p, 2, _bf16x2_min, keep_dims=True)
        out = tl.min(tl.minimum(_widen_lo(p), _widen_hi(p)), 0, keep_dims=True)
    return out


@triton.jit
def _widen_lo(w):
    return (w << 16).to(tl.float32, bitcast=True)


@triton.jit
def _widen_hi(w):
    return (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _rows_load(x_ptr, t, mask_t, head, stride_xt, stride_xh, C: tl.constexpr, G: tl.constexpr):
    """int4 rows as two [G, BLOCK_T, C, 4] fp32 tiles, the even and the odd columns: element
    (g, i, c, j) is column 2 (c * 4G + (g ^ 1) * 4 + j) (+ 1) of token t[i].

    Triton gives each thread one 16-byte vector (j) per (g, i, c) and assigns lanes to the other
    axes in their order (axes of equal contiguity in index order): G lanes per row, the rest of
    the lanes and the warps to tokens, C in registers. With G = 4, 2 warps and 16 tokens a thread
    holds 32 values of one row, so a row's min / max takes log2(G) shuffles and the per-row scale
    arithmetic runs once per thread (the [BLOCK_T, BLOCK_D] tile spreads rows over 16 lanes, 4
    rows a thread). The lane order g ^ 1 keeps each row's 8G columns one contiguous segment per c
    (coalesced loads) while hiding the contiguity of the packed words from Triton, whose store
    layout then is this one: no shared-memory conversion before the 4-byte stores.

    bf16 rows are loaded as 32-bit words and widened with one shift or mask per value (the even
    column is the low half); Triton's own cast extracts the high half first (two instructions)."""
    if x_ptr.dtype.element_ty == tl.bfloat16:
        w = _rows_words(x_ptr, t, mask_t, head, stride_xt, stride_xh, C, G)
        xe = _widen_lo(w)
        xo = _widen_hi(w)
    else:
        g = (tl.arange(0, G) ^ 1)[:, None, None, None]
        c = tl.arange(0, C)[None, None, :, None]
        j = tl.arange(0, 4)[None, None, None, :]
        m = mask_t[None, :, None, None]
        row = x_ptr + t * stride_xt + head * stride_xh
        v = tl.arange(0, 2)[None, None, None, None, :]
        x = tl.load(row[None, :, None, None, None] + (c * (8 * G) + g * 8 + 2 * j)[:, :, :, :, None] + v,
                    mask=m[:, :, :, :, None], other=0.0)
        xe, xo = tl.split(x.to(tl.float32))
    return xe, xo


@triton.jit
def _rows_reduce(xe, xo, MAX: tl.constexpr):
    """Row max (or min) of a pair of [G, BLOCK_T, C, 4] tiles as [1, BLOCK_T, 1, 1]: elementwise
    across the pair, the two in-thread axes, then the lanes."""
    if MAX:
        x = tl.maximum(xe, xo)
        out = tl.max(tl.max(tl.max(x, 3, keep_dims=True), 2, keep_dims=True), 0, keep_dims=True)
    else:
        x = tl.minimum(xe, xo)
        out = tl.min(tl.min(tl.min(x, 3, keep_dims=True), 2, keep_dims=True), 0, keep_dims=True)
    return out


@triton.jit
def _row_scale_store(lo, hi, scale_ptr, zero_ptr, meta_off, mask_t, G: tl.constexpr, ASYM: tl.constexpr,
                     QMAX: tl.constexpr, SCALE_DT: tl.constexpr):
    """A row's scale (and zero point) from its min and max (symmetric: hi = lo = amax), stored at
    its slot, as `kv_quant.dynamic_scales` rounds them; [1, BLOCK_T, 1, 1] in the tile's own layout
    (keep_dims: no conversion to broadcast them back), stored through a [G, BLOCK_T, 1, 1] view of
    them that only the lane g == 0 stores. Group scales ([1, BLOCK_T, C, 1]: `_words_reduce`'s
    GROUPED) go to slot meta * C + c."""
    if ASYM:
        z = _clamp_round(lo, SCALE_DT, False)
        s = tl.math.div_rn(hi - z, tl.full(z.shape, QMAX, tl.float32))
    else:
        z = 0.0
        s = tl.math.div_rn(hi, tl.full(hi.shape, QMAX, tl.float32))
    s = _clamp_round(s, SCALE_DT, True)
    T: tl.constexpr = s.shape[1]
    CS: tl.constexpr = s.shape[2]
    first = (tl.arange(0, G) == 0)[:, None, None, None] & mask_t[None, :, None, None]
    meta = meta_off[None, :, None, None] * CS + tl.arange(0, CS)[None, None, :, None]
    meta = tl.broadcast_to(meta, (G, T, CS, 1))
    first = tl.broadcast_to(first, (G, T, CS, 1))
    tl.store(scale_ptr + meta, tl.broadcast_to(s.to(scale_ptr.dtype.element_ty), (G, T, CS, 1)), mask=first)
    if ASYM:
        tl.store(zero_ptr + meta, tl.broadcast_to(z.to(zero_ptr.dtype.element_ty), (G, T, CS, 1)), mask=first)
    return s, z


@triton.jit
def _rows_int(x, s, y, b, ASYM: tl.constexpr, FAST: tl.constexpr, ONE_FMA: tl.constexpr,
              CLAMPED: tl.constexpr = False):
    """Clamped values (see `_rows_store`) / s, rounded half to even, as int32 (NaN -> 0).

    ONE_FMA (FAST, s with at most 11 significant bits: fp16 / bf16 per-token scales): one
    correction already gives the correctly rounded quotient. With y = RN(1/s), |s y - 1| <= 2**-24,
    q0 = RN(a y) = a/s + d, |d| < 2u (u the ulp of a/s); r = a - s q0 = -s d is exact in the fma
    (a multiple of ulp(s) ulp(q0) / 2 of at most 24 bits, far above underflow for
    s >= 2**-64 and |a/s| >= 2**-2), and q1 = RN(q0 + r y) = RN(a/s - e), |e| = |d (s y - 1)| < 2u 2**-24.
    q1 differs from RN(a/s) only if a midpoint M between two floats lies within |e| of a/s. But
    a/s = M is impossible (s M would need more than 24 bits), and a - s M is a nonzero multiple of
    ulp(s) u / 4 >= 2**-10 s u / 8, so |a/s - M| > 2**-13 u > |e|. (With a 24-bit s the gap can be
    2**-25 u, smaller than |e|: fp32 scales keep `_quotient`'s two corrections, Markstein's theorem.)"""
    if CLAMPED:  # `_rows_store_words` clamped the bf16 pairs already
        pass
    elif ASYM and FAST:
        # cvt.rni.u32 saturates negatives (a - z < 0 only where the zero point was clamped) to 0
        x = tl.minimum(x, b, propagate_nan=tl.PropagateNan.ALL)
    elif ASYM:
        x = tl.minimum(tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL), b, propagate_nan=tl.PropagateNan.ALL)
    else:
        x = tl.minimum(tl.maximum(x, -b, propagate_nan=tl.PropagateNan.ALL), b, propagate_nan=tl.PropagateNan.ALL)
    if FAST:
        q = _corrected(x, s, y, ONE_FMA)  # `_quotient` without its select: |x| <= b keeps every step finite
        if ASYM:
            n = libdevice.float2uint_rn(q).to(tl.int32, bitcast=True)  # NaN -> 0, < 0 -> 0
        else:
            n = libdevice.float2int_rn(q)  # NaN -> 0
    else:
        q = tl.math.div_rn(x, s)
        n = _rne(tl.where(q != q, 0.0, q)).to(tl.int32)
    return n


@triton.jit
def _rows_pack_store(ne, no, cache_ptr, dst_base, mask_t, ASYM: tl.constexpr):
    """Nibbles [G, BLOCK_T, C, 4] (even and odd columns) -> 32-bit words at the row's slot."""
    # bytes ne | no << 4 (the even column in the low nibble), 4 to a word by Horner's rule (one
    # shift-add each); the symmetric format's +8 per nibble is added once, as 0x88888888 (the
    # sum is exact mod 2**32 and every nibble ends in [0, 15])
    GL: tl.constexpr = ne.shape[0]
    T2: tl.constexpr = ne.shape[1]
    C: tl.constexpr = ne.shape[2]
    by = ne + (no << 4)
    b02, b13 = tl.split(tl.reshape(by, (GL, T2, C, 2, 2)))
    b0, b2 = tl.split(b02)
    b1, b3 = tl.split(b13)
    w = (b3 << 8) + b2
    w = (w << 8) + b1
    w = (w << 8) + b0
    if not ASYM:
        w = w + -2004318072  # 0x88888888 as int32
    g = (tl.arange(0, GL) ^ 1)[:, None, None]
    c = tl.arange(0, C)[None, None, :]
    words = (cache_ptr + dst_base).to(tl.pointer_type(tl.int32))
    tl.store(words[None, :, None] + (c * GL + g), w, mask=mask_t[None, :, None])


@triton.jit
def _rows_store(
    xe, xo, cache_ptr, scale_ptr, zero_ptr, mask_t, dst_base, meta_off, head,
    SCALE_MODE: tl.constexpr, ASYM: tl.constexpr, QMAX: tl.constexpr, SCALE_DT: tl.constexpr, FAST: tl.constexpr,
):
    """Quantize a `_rows_load` pair to int4 and store it as 32-bit words (8 nibbles each).

    Same bytes as `_quantize_rows`, with the clamp moved in front of the division: values are
    clamped to [-B, B] (asymmetric: [0, B], after the zero point) with B = QMAX * s rounded, in
    the NaN-propagating min / max. B / s = QMAX (1 + d), |d| <= 2**-24, rounds to QMAX, and the
    rounded quotient is monotone in the value, so a value beyond B quantizes to QMAX either way
    (and the asymmetric a - z >= 0 unless the zero point was clamped, where 0 is the answer
    too); so nothing needs clamping after the division, the quotients are finite (the
    correction of an infinite one would be inf - inf: `_quotient`'s |q0| < 2**64 select is not
    needed), and a NaN stays NaN until `cvt.rni` (FAST) or the where (interpreter) makes it 0.
    The power-of-two scaling k of `_reciprocal` is applied to the values before the clamp (the
    bound is computed from the scaled scale), as `_quotient` applies it."""
    if SCALE_MODE == codes.PER_TOKEN:
        if ASYM:
            lo = _rows_reduce(xe, xo, False)
            hi = _rows_reduce(xe, xo, True)
        else:
            hi = _rows_reduce(tl.abs(xe), tl.abs(xo), True)
            lo = hi
        s, z = _row_scale_store(lo, hi, scale_ptr, zero_ptr, meta_off, mask_t, xe.shape[0], ASYM, QMAX, SCALE_DT)
        if ASYM:
            xe = xe - z
            xo = xo - z
        if SCALE_DT == codes.SCALE_FP16:  # fp16 scales lie in [2**-14, 65504]: no scaling
            y = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        else:
            s, y, k = _reciprocal(s, True, True)
            xe = xe * k
            xo = xo * k
    else:
        if SCALE_MODE == codes.PER_HEAD:
            s = tl.load(scale_ptr + head)
        else:
            s = tl.load(scale_ptr)
        s, y, k = _reciprocal(s, True, True)
        xe = xe * k
        xo = xo * k
    b = s * QMAX
    ONE_FMA: tl.constexpr = SCALE_MODE == codes.PER_TOKEN and SCALE_DT != codes.SCALE_FP32
    ne = _rows_int(xe, s, y, b, ASYM, FAST, ONE_FMA)
    no = _rows_int(xo, s, y, b, ASYM, FAST, ONE_FMA)
    _rows_pack_store(ne, no, cache_ptr, dst_base, mask_t, ASYM)


@triton.jit
def _rows_bytes_store(ne, no, cache_ptr, dst_base, mask_t):
    """int8 values [G, BLOCK_T, C, 4] (even and odd columns, signed or unsigned) -> 32-bit words at the
    row's slot: a thread's 8 columns of one (g, c) are 8 bytes, two words, stored side by side."""
    GL: tl.constexpr = ne.shape[0]
    T2: tl.constexpr = ne.shape[1]
    C: tl.constexpr = ne.shape[2]
    h = (ne & 0xFF) + ((no & 0xFF) << 8)  # the column pair (2j, 2j + 1), low byte first
    h0, h1 = tl.split(tl.reshape(h, (GL, T2, C, 2, 2)))  # j = 2i and 2i + 1
    w = h0 + (h1 << 16)
    g = (tl.arange(0, GL) ^ 1)[:, None, None, None]
    c = tl.arange(0, C)[None, None, :, None]
    i = tl.arange(0, 2)[None, None, None, :]
    words = (cache_ptr + dst_base).to(tl.pointer_type(tl.int32))
    tl.store(words[None, :, None, None] + (c * GL + g) * 2 + i, w, mask=mask_t[None, :, None, None])


@triton.jit
def _rows_words(x_ptr, t, mask_t, head, stride_xt, stride_xh, C: tl.constexpr, G: tl.constexpr):
    """`_rows_load`'s bf16 tile as its [G, BLOCK_T, C, 4] words (two bf16 each, even column low)."""
    g = (tl.arange(0, G) ^ 1)[:, None, None, None]
    c = tl.arange(0, C)[None, None, :, None]
    j = tl.arange(0, 4)[None, None, None, :]
    row = (x_ptr + t * stride_xt + head * stride_xh).to(tl.pointer_type(tl.int32))
    return tl.load(row[None, :, None, None] + (c * (4 * G) + g * 4 + j), mask=mask_t[None, :, None, None], other=0)


@triton.jit
def _rows_store_words(
    w, cache_ptr, scale_ptr, zero_ptr, mask_t, dst_base, meta_off, ASYM: tl.constexpr, QMAX: tl.constexpr,
    KIND: tl.constexpr = 2, GROUPED: tl.constexpr = False,
):
    """`_rows_store` for bf16 rows, per-token fp16 scales, on the GPU, with bf16x2 instructions on the
    loaded words: the row min / max in-thread (one instruction per two values), and for the
    symmetric format the clamp, done on the bf16 pairs before widening, to [-B, B] with B = QMAX * s
    rounded to bf16 (B / s = QMAX (1 + d), |d| < 2**-8.9, rounds to QMAX, so `_rows_store`'s argument
    holds with this B -- for int8's 127 too, 127 * 2**-8.9 < 1/2 -- and s <= 65504 keeps B finite). The
    asymmetric clamp stays in fp32 (after a - z). KIND: int4 (2, nibbles) or int8 (1, bytes). GROUPED: group
    scales, one per c (groups of 8G channels; `write_mixed.py`): every step below broadcasts them as it does a
    row's."""
    if ASYM:
        lo = _words_reduce(w, False, GROUPED)
        hi = _words_reduce(w, True, GROUPED)
    else:
        hi = _words_reduce(w & 0x7FFF7FFF, True, GROUPED)
        lo = hi
    s, z = _row_scale_store(lo, hi, scale_ptr, zero_ptr, meta_off, mask_t, w.shape[0], ASYM, QMAX, 0)
    y = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    b = s * QMAX
    if ASYM:
        xe = _widen_lo(w) - z
        xo = _widen_hi(w) - z
        ne = _rows_int(xe, s, y, b, ASYM, True, True)
        no = _rows_int(xo, s, y, b, ASYM, True, True)
    else:
        hb = b.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi_w = hb | (hb << 16)
        w = _bf16x2_clamp(w, hi_w | -2147450880, hi_w)  # -2147450880 = 0x80008000: the sign bits
        ne = _rows_int(_widen_lo(w), s, y, b, ASYM, True, True, True)
        no = _rows_int(_widen_hi(w), s, y, b, ASYM, True, True, True)
    if KIND == codes.INT4:
        _rows_pack_store(ne, no, cache_ptr, dst_base, mask_t, ASYM)
    else:
        _rows_bytes_store(ne, no, cache_ptr, dst_base, mask_t)


@triton.jit
def _rows_store_fp8_words(w, cache_ptr, scale_ptr, mask_t, dst_base, meta_off, FP8: tl.constexpr,
                          QMIN: tl.constexpr, QMAX: tl.constexpr, GROUPED: tl.constexpr = False):
    """`_rows_store_words` for fp8 per-token (fp16 scales, bf16 rows, the GPU's conversion): the row's amax on
    the bf16 pairs, then each value through the tile path's quotient and encoding (`_quotient`, `_fp8_byte`),
    with one fma correction (an fp16 scale has 11 significant bits: `_rows_int`'s argument) where the tile
    takes two: the correctly rounded fp32 quotient either way, so the tile's bytes. GROUPED: `_rows_store_words`'s."""
    hi = _words_reduce(w & 0x7FFF7FFF, True, GROUPED)
    s, _ = _row_scale_store(hi, hi, scale_ptr, scale_ptr, meta_off, mask_t, w.shape[0], False, QMAX, 0)
    y = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)  # `_reciprocal` of an fp16 scale (>= 2**-14): k = 1
    ne = _fp8_byte(_quotient(_widen_lo(w), s, y, 1.0, True, True), FP8, QMIN, QMAX).to(tl.int32)
    no = _fp8_byte(_quotient(_widen_hi(w), s, y, 1.0, True, True), FP8, QMIN, QMAX).to(tl.int32)
    _rows_bytes_store(ne, no, cache_ptr, dst_base, mask_t)
