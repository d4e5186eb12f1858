"""Property tests of the KV format math (runtime/kv_format.py).

Inputs are random tensors with outliers, exact zeros and extreme values; the
expected bounds come from the format definitions (half a quantization step for
integers, half an ulp of the fp8 mantissa), computed in fp64 here, not by the
code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from runtime.kv_format import KVFormat, format_from_name
from runtime.kv_quant import (
    dequantize,
    dynamic_scales,
    pack_int4,
    per_channel_scales,
    quantize,
    quantize_dynamic,
    static_scale_from_amax,
    unpack_int4,
)

INT_FORMATS_SYM = [KVFormat("int8", g) for g in ("per_tensor", "per_head")] + [
    KVFormat("int4", g) for g in ("per_tensor", "per_head")
]
DYNAMIC_INT = [
    KVFormat(d, "per_token", sym, sd)
    for d in ("int8", "int4")
    for sym in (True, False)
    for sd in ("float16", "float32", "bfloat16")
]
FP8 = ["fp8_e4m3", "fp8_e5m2"]
MANTISSA = {"fp8_e4m3": 3, "fp8_e5m2": 2}
MIN_SUBNORMAL = {"fp8_e4m3": 2.0**-9, "fp8_e5m2": 2.0**-16}

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def kv_tensors(draw, max_abs: float = 2.0**14):
    """[tokens, kv_heads, head_dim] fp32 with zeros, outliers and a wide dynamic range."""
    t = draw(st.integers(1, 5))
    h = draw(st.integers(1, 3))
    d = draw(st.sampled_from([2, 4, 8, 16]))
    base = draw(st.sampled_from([2.0**-10, 1.0, 32.0]))
    elems = st.one_of(
        st.floats(-base, base, width=32),
        st.just(0.0),
        st.floats(-max_abs, max_abs, width=32),  # outliers
    )
    arr = draw(hnp.arrays(np.float32, (t, h, d), elements=elems))
    return torch.from_numpy(arr)


def _per_head_amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(dim=(0, 2))


@pytest.mark.parametrize("fmt", INT_FORMATS_SYM, ids=lambda f: f.name)
@SETTINGS
@given(x=kv_tensors())
def test_static_int_roundtrip_within_half_step(fmt, x):
    amax = _per_head_amax(x) if fmt.granularity == "per_head" else x.abs().amax()
    scale = static_scale_from_amax(amax, fmt)
    q = quantize(x, fmt, scale)
    back = dequantize(q, fmt, scale).double()
    s = scale.double().unsqueeze(-1) if scale.dim() else scale.double()
    err = (back - x.double()).abs()
    # Half a step, plus fp32 rounding of the x/s division and q*s product.
    bound = s / 2 * (1 + 1e-6) + x.double().abs() * 2e-7
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"


@pytest.mark.parametrize("fmt", DYNAMIC_INT, ids=lambda f: f"{f.name}-{f.scale_dtype}")
@SETTINGS
@given(x=kv_tensors())
def test_dynamic_int_roundtrip_within_half_step(fmt, x):
    q, scale, zero = quantize_dynamic(x, fmt)
    assert scale.shape == x.shape[:-1] and scale.dtype == fmt.scale_torch_dtype
    back = dequantize(q, fmt, scale, zero).double()
    s = scale.double().unsqueeze(-1)
    bound = s / 2 * (1 + 1e-6) + x.double().abs() * 2e-7
    err = (back - x.double()).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"
    if zero is not None:  # asymmetric integers use the whole unsigned range
        vals = unpack_int4(q) if fmt.dtype == "int4" else q
        assert int(vals.max()) <= fmt.qmax and int(vals.min()) >= 0


@pytest.mark.parametrize("fmt", DYNAMIC_INT[:6], ids=lambda f: f"{f.name}-{f.scale_dtype}")
@SETTINGS
@given(x=kv_tensors())
def test_per_token_scales_are_per_token_and_head(fmt, x):
    scale, zero = dynamic_scales(x, fmt)
    xd = x.double().numpy()
    sd = fmt.scale_torch_dtype
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            row = xd[t, h]
            lo = 0.0 if fmt.symmetric else float(zero[t, h])
            if not fmt.symmetric:
                assert lo <= row.min()
            need = (np.abs(row).max() if fmt.symmetric else row.max() - lo) / fmt.qmax
            s = float(scale[t, h])
            # Rounded up (to within the fp32 division's rounding): every element fits.
            assert s >= need * (1 - 2.0**-23)
            # ... and the smallest such value of the scale dtype (or its smallest normal).
            below = torch.nextafter(scale[t, h], torch.tensor(0.0, dtype=sd))
            assert float(below) < need or s <= torch.finfo(sd).tiny


@pytest.mark.parametrize("dtype", FP8)
@SETTINGS
@given(x=kv_tensors(max_abs=2.0**100), scale=st.sampled_from([1e-3, 0.05, 1.0, 37.0]))
def test_fp8_saturates_never_nan(dtype, x, scale):
    fmt = KVFormat(dtype, "per_tensor")
    s = torch.tensor(scale)
    q = quantize(x, fmt, s)
    back = dequantize(q, fmt, s).double()
    assert not bool(torch.isnan(back).any()) and not bool(torch.isinf(back).any())
    xd = x.double()
    top = fmt.qmax * scale
    inside = xd.abs() <= top
    # In range: round to nearest -> half a mantissa ulp relative, or half the subnormal step.
    rel = 2.0 ** -(MANTISSA[dtype] + 1)
    bound = xd.abs() * rel + MIN_SUBNORMAL[dtype] * scale / 2 + 1e-12
    err = (back - xd).abs()
    assert bool((err[inside] <= bound[inside] * (1 + 1e-6)).all())
    # Out of range: saturated to +-qmax * s, sign kept.
    out = ~inside
    expected = torch.sign(xd[out]) * fmt.qmax * scale
    assert torch.allclose(back[out], expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", [KVFormat("int8", "per_tensor"), KVFormat("int4", "per_tensor")], ids=lambda f: f.name)
def test_integers_clamp_instead_of_wrapping(fmt):
    s = torch.tensor(0.5)
    x = torch.tensor([[[1e6, -1e6, 3e38, -3e38]]])
    back = dequantize(quantize(x, fmt, s), fmt, s)
    assert back.flatten().tolist() == [fmt.qmax * 0.5, -fmt.qmax * 0.5] * 2


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_integers_round_half_to_even(dtype):
    fmt = KVFormat(dtype, "per_tensor")
    s = torch.tensor(1.0)
    x = torch.tensor([[[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 0.0]]])
    back = dequantize(quantize(x, fmt, s), fmt, s)
    assert back.flatten().tolist() == [0.0, 2.0, 2.0, 0.0, -2.0, -2.0, 4.0, 0.0]


def test_int4_pack_unpack_exact_for_every_nibble_pair():
    a = torch.arange(16, dtype=torch.uint8).repeat_interleave(16)
    b = torch.arange(16, dtype=torch.uint8).repeat(16)
    nibbles = torch.stack((a, b), dim=-1).flatten()  # all 256 (low, high) pairs
    packed = pack_int4(nibbles)
    assert packed.dtype == torch.uint8 and packed.numel() == 256
    assert sorted(packed.tolist()) == list(range(256))  # every byte exactly once
    assert torch.equal(unpack_int4(packed), nibbles)
    # Even index in the low nibble (the layout the kernels read).
    assert pack_int4(torch.tensor([3, 12], dtype=torch.uint8)).item() == 3 | (12 << 4)


@SETTINGS
@given(x=kv_tensors(max_abs=2.0**100))
def test_dynamic_formats_never_nan_on_extreme_values(x):
    for fmt in (KVFormat("int8", "per_token", False), KVFormat("int4", "per_token"), KVFormat("fp8_e4m3", "per_token")):
        q, scale, zero = quantize_dynamic(x, fmt)
        back = dequantize(q, fmt, scale, zero)
        assert torch.isfinite(back).all(), fmt.name


def test_one_nan_leaves_its_token_alone():
    """A NaN value stores as 0 and stays out of its token's scale (and zero point): the other
    values quantize exactly as without it (GPU min/max skip NaN; the kernels match this)."""
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(3))
    x_nan = x.clone()
    x_nan[1, 2, 5] = float("nan")
    for fmt in DYNAMIC_INT + [KVFormat("fp8_e4m3", "per_token")]:
        s_ref, z_ref = dynamic_scales(x[..., [i for i in range(8) if i != 5]], fmt)
        s, z = dynamic_scales(x_nan, fmt)
        assert torch.equal(s[1, 2], s_ref[1, 2]) and torch.isfinite(s).all(), fmt.name
        if z is not None:
            assert torch.equal(z[1, 2], z_ref[1, 2]), fmt.name
        back = dequantize(quantize(x_nan, fmt, s, z), fmt, s, z)
        assert torch.isfinite(back).all(), fmt.name


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _round_up_oracle(x: np.ndarray, dtype) -> np.ndarray:
    """fp64 values -> the smallest `dtype` value >= each (numpy's correctly rounded casts)."""
    r = x.astype(dtype)
    up = r.astype(np.float64) < x
    r[up] = np.nextafter(r[up], np.array(np.inf, dtype))
    return r.astype(np.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_scales_are_the_correctly_rounded_quotient_on_every_device(device):
    """s = (max - zero) / qmax, the fp32 quotient correctly rounded then rounded up to fp16, as an fp64 oracle
    computes it (an fp64 quotient of fp32 operands rounds to the fp32 quotient exactly): per token and per
    channel, on the CPU and on CUDA (whose torch kernels divide by a Python number through its reciprocal)."""
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(5)) * 3
    for fmt, scales, axis in ((KVFormat("int4", "per_token", False), dynamic_scales, -1),
                              (KVFormat("int8", "per_token", True), dynamic_scales, -1),
                              (format_from_name("k.int4-per_channel-asym+v.int4-per_token-asym").k,
                               per_channel_scales, -2)):
        xb = x.view(64, 64, 64) if axis == -2 else x  # per channel: blocks of 64 keys
        s, zero = scales(xb.to(device), fmt)
        xn = xb.numpy().astype(np.float64)
        if fmt.symmetric:
            span = np.abs(xn).max(axis=axis)
        else:
            span = (xn.max(axis=axis) - zero.cpu().double().numpy()).astype(np.float32).astype(np.float64)
        want = _round_up_oracle((span / fmt.qmax).astype(np.float32).astype(np.float64), np.float16)
        assert np.array_equal(s.cpu().double().numpy(), want), (fmt.name, device)


def test_zeros_stay_exact_zero():
    x = torch.zeros(2, 3, 8)
    for fmt in DYNAMIC_INT + [KVFormat("fp8_e4m3", "per_token"), KVFormat("fp8_e5m2", "per_token")]:
        q, scale, zero = quantize_dynamic(x, fmt)
        assert torch.equal(dequantize(q, fmt, scale, zero), x), fmt.name
    assert math.isfinite(float(static_scale_from_amax(torch.tensor(0.0), KVFormat("int8"))))
