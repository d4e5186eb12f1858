"""The reference math of the KV formats (runtime/kv_format.py): quantize and dequantize.

Everything that quantizes or dequantizes KV in kvq -- the reference attention
path, calibration's error estimates, the Triton kernels' tests -- uses the
functions here, so there is one definition of every rounding decision:

* write path: divide by the scale, clamp to the representable range, then
  round to nearest even (integers: torch.round; fp8: the cast itself). Clamping
  first matters: an fp8 cast of an out-of-range value is NaN in some torch
  builds and saturates in Triton, so we never rely on either.
* dynamic (per_token) scales are rounded *up* to the scale dtype, and
  asymmetric zero points *down*, so every element of the token-head is inside
  the representable range after rounding and the round-trip error stays within
  half a quantization step of the scale that is actually stored.
* int4 packs two values per byte: element 2j in the low nibble, 2j+1 in the
  high nibble. Symmetric values [-7, 7] are stored with a +8 offset;
  asymmetric values are [0, 15].
"""

from __future__ import annotations

import torch

from .kv_format import KVFormat


def _tiny(dtype: torch.dtype) -> float:
    # e8m0's 2**-127 is subnormal in fp32: its scales stay >= 2**-126, so every kernel rounds them alike
    return max(float(torch.finfo(dtype).tiny), float(torch.finfo(torch.float32).tiny))


def round_up_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest value of `dtype` >= x (x finite; e8m0: x > 0), returned in `dtype`."""
    if dtype == torch.float8_e8m0fnu:  # the next power of two: frexp's mantissa is 0.5 exactly on one
        m, e = torch.frexp(x.to(torch.float32))
        return torch.ldexp(torch.ones_like(m), torch.where(m == 0.5, e - 1, e)).to(dtype)
    r = x.to(dtype)
    if dtype == x.dtype:
        return r
    return torch.where(r.to(x.dtype) < x, torch.nextafter(r, torch.full_like(r, float("inf"))), r)


def round_down_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest value of `dtype` <= x (x finite), returned in `dtype`."""
    r = x.to(dtype)
    if dtype == x.dtype:
        return r
    return torch.where(r.to(x.dtype) > x, torch.nextafter(r, torch.full_like(r, float("-inf"))), r)


# ------------------------------------------------------------------ scales
def _over_qmax(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """x / qmax, correctly rounded on every device: torch's CUDA kernels divide by a Python number through its
    reciprocal (one ulp above the quotient at times, which round_up_to turns into a whole step of the scale
    dtype), and by a tensor with IEEE division, as the CPU and the write kernels do."""
    return x / torch.full((), fmt.qmax, dtype=x.dtype, device=x.device)


def static_scale_from_amax(amax: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Calibrated dequantization scale s = amax / qmax (fp32), never zero."""
    if not fmt.static:
        raise ValueError(f"{fmt.name} has no static scales")
    s = _over_qmax(amax.to(torch.float32), fmt)
    return s.clamp_min(_tiny(torch.float32))


def dynamic_scales(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-(token, head) scale and zero point for x[..., head_dim], in fmt.scale_dtype: [...]
    without group scales, [..., head_dim / group_size] with them (one per group of channels).

    Symmetric: s = amax / qmax rounded up. Asymmetric: zero = min rounded down,
    s = (max - zero) / qmax rounded up, so [min, max] fits in [0, qmax].
    NaNs are left out of amax / min / max (quantize stores them as 0), so one NaN
    does not turn its token's scale into NaN -- as the GPU's min/max instructions do.
    """
    if not fmt.dynamic:
        raise ValueError(f"{fmt.name} has no dynamic scales")
    xf = _grouped(x.to(torch.float32), fmt)
    nan = xf.isnan()
    sd = fmt.scale_torch_dtype
    # Clamp to the scale dtype's finite range: a token beyond max * qmax saturates
    # (like a static scale clips) instead of storing an inf scale that dequantizes to NaN.
    big = float(torch.finfo(sd).max)
    if fmt.symmetric:
        s = _over_qmax(xf.abs().masked_fill(nan, 0.0).amax(dim=-1), fmt)
        return round_up_to(s.clamp(_tiny(sd), big), sd), None
    zero = round_down_to(xf.masked_fill(nan, float("inf")).amin(dim=-1).clamp(-big, big), sd)
    s = _over_qmax(xf.masked_fill(nan, float("-inf")).amax(dim=-1) - zero.to(torch.float32), fmt)
    return round_up_to(s.clamp(_tiny(sd), big), sd), zero


# ------------------------------------------------------------ int4 packing
def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 2n] values in 0..15 -> [..., n] uint8 (even index in the low nibble)."""
    n = nibbles.to(torch.uint8)
    return n[..., 0::2] | (n[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n] uint8 values in 0..15."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ------------------------------------------------------- quantize / dequant
def _grouped(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """x[..., head_dim] -> [..., groups, group_size] for group-scaled formats (x unchanged otherwise)."""
    if not fmt.group_size:
        return x
    return x.unflatten(-1, (fmt.groups(x.shape[-1]), fmt.group_size))


def _expand(t: torch.Tensor | None) -> torch.Tensor | None:
    """Scales are shaped like x[..., :-1] (or broadcast to it): add the head_dim axis."""
    if t is None:
        return None
    t = t.to(torch.float32)
    return t.unsqueeze(-1) if t.dim() else t


def quantize(
    x: torch.Tensor, fmt: KVFormat, scale: torch.Tensor | None = None, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """x[..., head_dim] -> storage tensor (packed for int4).

    `scale`/`zero` broadcast to x.shape[:-1]: a scalar (per_tensor), [kv_heads]
    (per_head, x laid out [..., kv_heads, head_dim]) or [..., kv_heads] (per_token);
    with group scales [..., kv_heads, groups].
    """
    if not fmt.quantized:
        return x.to(fmt.storage_dtype)
    if scale is None:
        raise ValueError(f"{fmt.name} needs a scale")
    y = _grouped(x.to(torch.float32), fmt)
    if zero is not None:
        y = y - _expand(zero)
    y = torch.nan_to_num(y / _expand(scale), nan=0.0)
    y = y.clamp(fmt.qmin, fmt.qmax).flatten(-2) if fmt.group_size else y.clamp(fmt.qmin, fmt.qmax)
    if fmt.is_fp8:
        return y.to(fmt.storage_dtype)  # the cast rounds to nearest even
    q = torch.round(y)  # round half to even
    if fmt.dtype == "int8":
        return q.to(fmt.storage_dtype)
    nib = q + 8 if fmt.symmetric else q
    return pack_int4(nib)


def dequantize(
    q: torch.Tensor,
    fmt: KVFormat,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of quantize: storage -> values in `dtype` (x ~= q * s + zero)."""
    if not fmt.quantized:
        return q.to(dtype)
    if fmt.dtype == "int4":
        v = unpack_int4(q).to(torch.float32)
        if fmt.symmetric:
            v = v - 8
    else:
        v = q.to(torch.float32)
    v = _grouped(v, fmt) * _expand(scale)
    if zero is not None:
        v = v + _expand(zero)
    return (v.flatten(-2) if fmt.group_size else v).to(dtype)


def quantize_dynamic(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token write: (storage, scale, zero) for x[..., head_dim]."""
    scale, zero = dynamic_scales(x, fmt)
    return quantize(x, fmt, scale, zero), scale, zero


# ---------------------------------------------------- per-channel keys
def per_channel_scales(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero per channel of a block of keys x[..., tokens, head_dim] -> two [..., head_dim] in
    fmt.scale_dtype: zero = min over the block's tokens rounded down, s = (max - zero) / qmax rounded up, so the
    block's [min, max] fits in [0, qmax] (the per-token rule, along the other axis). NaNs are left out."""
    if not fmt.per_channel_keys:
        raise ValueError(f"{fmt.name} has no per-channel scales")
    xf = x.to(torch.float32)
    nan = xf.isnan()
    sd = fmt.scale_torch_dtype
    big = float(torch.finfo(sd).max)
    zero = round_down_to(xf.masked_fill(nan, float("inf")).amin(dim=-2).clamp(-big, big), sd)
    s = _over_qmax(xf.masked_fill(nan, float("-inf")).amax(dim=-2) - zero.to(torch.float32), fmt)
    return round_up_to(s.clamp(_tiny(sd), big), sd), zero


def quantize_per_channel(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block of keys x[..., tokens, head_dim] -> (packed [..., tokens, head_dim / 2] uint8, scale, zero
    [..., head_dim]): q = clamp(round_half_even((x - zero) / s), 0, qmax), two per byte along the channels."""
    scale, zero = per_channel_scales(x, fmt)
    y = (x.to(torch.float32) - zero.to(torch.float32).unsqueeze(-2)) / scale.to(torch.float32).unsqueeze(-2)
    q = torch.round(torch.nan_to_num(y, nan=0.0).clamp(0.0, fmt.qmax))
    return pack_int4(q), scale, zero


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_per_channel: packed [..., tokens, head_dim / 2] -> [..., tokens, head_dim] in `dtype`."""
    v = unpack_int4(q).to(torch.float32) * scale.to(torch.float32).unsqueeze(-2)
    return (v + zero.to(torch.float32).unsqueeze(-2)).to(dtype)
