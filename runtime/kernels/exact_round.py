"""Exact rounding steps shared by the write kernels (`write_kv.py`, `write_rows.py`): round half to
even by the 1.5 * 2**23 trick, and rounding fp32 scales up / zero points down to the scale dtype
(comparing the cast with the fp32 value and stepping one ulp through the bit pattern, which is right
whichever way the cast itself rounds)."""

from __future__ import annotations

import triton
import triton.language as tl

_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds |y| < 2**22 half-to-even


@triton.jit
def _rne(y):
    return (y + _RNE_MAGIC) - _RNE_MAGIC


_SMALL = tl.constexpr(5.421010862427522e-20)  # 2**-64: scales below it are scaled up for _quotient
_HUGE = tl.constexpr(1.8446744073709552e19)  # 2**64: any quotient this large saturates whatever its digits


@triton.jit
def _to_scale_dtype(x, SCALE_DT: tl.constexpr):
    if SCALE_DT == 0:
        return x.to(tl.float16)
    elif SCALE_DT == 1:
        return x.to(tl.bfloat16)
    else:
        return x


@triton.jit
def _from_bits(bits, SCALE_DT: tl.constexpr):
    """The fp16 (SCALE_DT 0) or bf16 (1) values of int16 bit patterns."""
    if SCALE_DT == 0:
        v = bits.to(tl.float16, bitcast=True)
    else:
        v = bits.to(tl.bfloat16, bitcast=True)
    return v


@triton.jit
def _round_up(x, SCALE_DT: tl.constexpr):
    """Smallest scale-dtype value >= x (x > 0), returned as fp32."""
    if SCALE_DT == 2:
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
    if SCALE_DT == 2:
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
    if SCALE_DT == 0:
        TINY: tl.constexpr = 6.103515625e-05
        BIG: tl.constexpr = 65504.0
    elif SCALE_DT == 1:
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
