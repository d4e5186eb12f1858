"""Exact rounding steps shared by the write kernels (`write_kv.py`, `write_rows.py`): round half to
even by the 1.5 * 2**23 trick, rounding fp32 scales up / zero points down to the scale dtype
(comparing the cast with the fp32 value and stepping one ulp through the bit pattern, which is right
whichever way the cast itself rounds), the correctly rounded quotient through a reciprocal, and fp8
encoding (the hardware's, or the interpreter's in integers)."""

from __future__ import annotations

import triton
import triton.language as tl

from . import codes

_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds |y| < 2**22 half-to-even


@triton.jit
def _rne(y):
    return (y + _RNE_MAGIC) - _RNE_MAGIC


_SMALL = tl.constexpr(5.421010862427522e-20)  # 2**-64: scales below it are scaled up for _quotient
_HUGE = tl.constexpr(1.8446744073709552e19)  # 2**64: any quotient this large saturates whatever its digits


@triton.jit
def _to_scale_dtype(x, SCALE_DT: tl.constexpr):
    if SCALE_DT == codes.SCALE_FP16:
        return x.to(tl.float16)
    elif SCALE_DT == codes.SCALE_BF16:
        return x.to(tl.bfloat16)
    else:
        return x


@triton.jit
def _from_bits(bits, SCALE_DT: tl.constexpr):
    """The fp16 (SCALE_DT 0) or bf16 (1) values of int16 bit patterns."""
    if SCALE_DT == codes.SCALE_FP16:
        v = bits.to(tl.float16, bitcast=True)
    else:
        v = bits.to(tl.bfloat16, bitcast=True)
    return v


@triton.jit
def _round_up(x, SCALE_DT: tl.constexpr):
    """Smallest scale-dtype value >= x (x > 0), returned as fp32."""
    if SCALE_DT == codes.SCALE_FP32:
        out = x
    else:
        r = _to_scale_dtype(x, SCALE_DT)
        bits = r.to(tl.int16, bitcast=True)
        # x > 0, so one more in the bit pattern is the next value up
        up = _from_bits(bits + 1, SCALE_DT)
        rf = r.to(tl.float32)
        out = tl.where(rf < x, up.to(tl.float32), rf)
    return out


@triton.jit
def _round_down(x, SCALE_DT: tl.constexpr):
    """Largest scale-dtype value <= x (any sign), returned as fp32."""
    if SCALE_DT == codes.SCALE_FP32:
        out = x
    else:
        r = _to_scale_dtype(x, SCALE_DT)
        bits = r.to(tl.int16, bitcast=True)
        # sign-magnitude: positive -> bits - 1; negative (and -0) -> bits + 1; +0 -> -smallest subnormal
        step = tl.where(bits > 0, bits - 1, tl.where(bits == 0, -32767, bits + 1)).to(tl.int16)
        down = _from_bits(step, SCALE_DT)
        rf = r.to(tl.float32)
        out = tl.where(rf > x, down.to(tl.float32), rf)
    return out


@triton.jit
def _reciprocal(s, SCALE_UP: tl.constexpr, SCALE_DOWN: tl.constexpr = False):
    """(s', 1 / s' rounded to nearest, k) with s' = s * k, k a power of two that keeps s' >= 2**-64.

    Scaling both sides of a / s by the same power of two is exact, and it keeps the
    fma corrections of `write_kv._quotient` clear of underflow (scales of 1e-38 are legal in fp32).
    SCALE_UP False: the caller knows s >= 2**-64 (fp16 scales are >= 2**-14), k = 1. SCALE_DOWN:
    scales from 2**64 up are scaled down to below it too (`write_rows._rows_store`'s clamp bound
    QMAX * s must be finite; scaling a by 2**-64 is inexact only for |a| < 2**-62, whose quotients,
    below 2**-126, round to 0 with or without it)."""
    if SCALE_DOWN:
        k = tl.where(s < _SMALL, _HUGE, tl.where(s >= _HUGE, _SMALL, 1.0))
        s = s * k
    elif SCALE_UP:
        k = tl.where(s < _SMALL, _HUGE, 1.0)
        s = s * k
    else:
        k = 1.0
    return s, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), k


@triton.jit
def _clamp_round(x, SCALE_DT: tl.constexpr, UP: tl.constexpr):
    """UP: a scale, clamped to the scale dtype's [smallest normal, largest finite] (torch.finfo tiny /
    max) and rounded up to it; else a zero point, clamped to its finite range and rounded down."""
    if SCALE_DT == codes.SCALE_FP16:
        TINY: tl.constexpr = 6.103515625e-05
        BIG: tl.constexpr = 65504.0
    elif SCALE_DT == codes.SCALE_BF16:
        TINY: tl.constexpr = 1.1754943508222875e-38
        BIG: tl.constexpr = 3.3895313892515355e38
    else:
        TINY: tl.constexpr = 1.1754943508222875e-38
        BIG: tl.constexpr = 3.4028234663852886e38
    if UP:
        out = _round_up(tl.minimum(tl.maximum(x, TINY), BIG), SCALE_DT)
    else:
        out = _round_down(tl.minimum(tl.maximum(x, -BIG), BIG), SCALE_DT)
    return out


@triton.jit
def _corrected(a, s, y, ONE_FMA: tl.constexpr):
    """`_quotient`'s FAST steps: q0 = a * y and one or two fma corrections q + (s q - a) (-y), for a whose
    quotient stays finite (callers that cannot promise it select a * y past 2**64)."""
    q0 = a * y
    # true negations (Triton's -x is 0 - x, which is +0 at x = -0 and costs an add): operand modifiers
    na = a * -1.0
    ny = y * -1.0
    q = tl.fma(tl.fma(s, q0, na), ny, q0)
    if not ONE_FMA:
        q = tl.fma(tl.fma(s, q, na), ny, q)
    return q


@triton.jit
def _quotient(a, s, y, k, FAST: tl.constexpr, ONE_FMA: tl.constexpr = False):
    """a / s rounded to nearest even, as IEEE division (s > 0; s, y, k from `_reciprocal`), -0 / s = -0 included.

    FAST: q = a * y is within 2 ulp of a / s; one fma correction brings it within
    1 ulp, and by Markstein's theorem (y the rounded reciprocal, no underflow) the
    second returns the correctly rounded quotient. ONE_FMA: the first already does, for scales of
    <= 11 significant bits (fp16 / bf16 per-token scales; `write_rows._rows_int` has the argument; its
    residual is exact while ulp(s) ulp(q0) / 2 >= 2**-149, i.e. for |a/s| >= 2**-100, and smaller
    quotients round to zero in every format). A quotient past 2**64 is kept as a * y: it saturates in every
    format, and its correction would be inf - inf. Each correction is q + (s q - a) (-y): for a = -0 that keeps
    q = -0 (fp8 stores -0 as a byte of its own), where q + (a - s q) y gives -0 + +0 = +0."""
    if FAST:
        a = a * k
        q = _corrected(a, s, y, ONE_FMA)
        q = tl.where(tl.abs(a * y) < _HUGE, q, a * y)
    else:
        q = tl.math.div_rn(a * k, s)
    return q


@triton.jit
def _encode_fp8(y, FP8: tl.constexpr):
    """fp32 (finite, already clamped to +-max) -> fp8 byte, round to nearest even."""
    if FP8 == codes.FP8_E5M2:  # e5m2
        MB: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        MIN_NORMAL: tl.constexpr = 6.103515625e-05  # 2**-14
        SUB_Q: tl.constexpr = 65536.0  # 1 / 2**-16, the subnormal step
    else:  # e4m3fn
        MB: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        MIN_NORMAL: tl.constexpr = 0.015625  # 2**-6
        SUB_Q: tl.constexpr = 512.0  # 1 / 2**-9
    SHIFT: tl.constexpr = 23 - MB
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    abits = a.to(tl.int32, bitcast=True)
    # normal numbers: round the fp32 mantissa to MB bits (carry may bump the exponent), rebias
    r = (abits + ((1 << (SHIFT - 1)) - 1) + ((abits >> SHIFT) & 1)) >> SHIFT
    code_n = r - ((127 - BIAS) << MB)
    # subnormals (and the step up to the smallest normal): multiples of the subnormal step
    code_s = _rne(tl.minimum(a, MIN_NORMAL) * SUB_Q).to(tl.int32)
    code = tl.where(a < MIN_NORMAL, code_s, code_n)
    return (code | sign).to(tl.uint8)


@triton.jit
def _fp8_byte(q, FP8: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """A quotient (`_quotient`) -> its fp8 byte: NaN -> 0, clamped to [QMIN, QMAX], rounded to nearest even."""
    q = tl.minimum(tl.maximum(tl.where(q != q, 0.0, q), QMIN), QMAX)
    if FP8 == codes.FP8_E4M3_HW:  # a fast plan (formats.write_fp8): cvt.rn.satfinite, the same RNE on the clamped value
        out = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif FP8 == codes.FP8_E5M2_HW:  # formats.write_fp8 (a fast plan), e5m2
        out = q.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        out = _encode_fp8(q, FP8)
    return out
