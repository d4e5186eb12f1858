"""K and V of their own formats, group scales, e8m0 scales: the format object, its names, its bytes (planner ==
allocated pool), its reference math against fp64, recipes (round trip, errors naming the field) and TensorRT-LLM's
rejection with the formats it supports."""

from __future__ import annotations

import pytest
import torch

from runtime.config import PRESETS
from runtime.errors import UnsupportedError
from runtime.kv_cache import allocate_layer
from runtime.kv_format import KVFormat, format_fields, format_from_name, kv_bytes_per_token
from runtime.kv_quant import dequantize, dynamic_scales, quantize_dynamic

K8V4 = KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False)
NEW = [
    K8V4,
    KVFormat("fp8_e4m3", "per_token", v_dtype="int4", v_symmetric=False),
    KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False, v_group_size=32),
    KVFormat("int4", "per_token", False, group_size=64),
    KVFormat("int4", "per_token", False, group_size=32),
    KVFormat("int4", "per_token", False, "float32", 32),
    KVFormat("int4", "per_token", True, "e8m0", 32),
    KVFormat("int8", "per_token", True, "bfloat16", 32),
    KVFormat("fp8_e4m3", "per_token", True, "e8m0", 32),
]


def test_sides_and_split():
    assert K8V4.split and K8V4.k == KVFormat("int8", "per_token") and K8V4.v == KVFormat("int4", "per_token", False)
    assert K8V4.side("v") == K8V4.v and not K8V4.v.split
    uniform = KVFormat("int4", "per_token", False, group_size=64)
    assert not uniform.split and uniform.k is uniform and uniform.v is uniform
    # V given as K's is the same format, one spelling
    assert KVFormat("int8", "per_token", v_dtype="int8") == KVFormat("int8", "per_token")
    with pytest.raises(UnsupportedError, match="fmt.k or fmt.v"):
        K8V4.qmax  # noqa: B018


@pytest.mark.parametrize("fmt", NEW, ids=lambda f: f.name)
def test_name_round_trip(fmt):
    assert format_from_name(fmt.name) == fmt
    assert KVFormat(**format_fields(fmt)) == fmt


def test_bits_per_element():
    # K int8 + fp16 scale, V int4 + fp16 scale and zero, at head_dim 128: (8.125 + 4.25) / 2
    assert K8V4.bits_per_element(128) == pytest.approx(6.1875)
    assert 16 / K8V4.bits_per_element(128) == pytest.approx(2.586, abs=1e-3)
    g64 = KVFormat("int4", "per_token", False, group_size=64)
    assert g64.bits_per_element(128) == g64.bits_per_element(64) == 4.5  # the all-INT4 format's budget
    assert KVFormat("int4", "per_token", True, "e8m0", 32).bits_per_element(128) == 4.25


@pytest.mark.parametrize("bad, match", [
    (dict(dtype="int8", granularity="per_tensor", v_dtype="int4"), "kv.k: .*per_token granularity"),
    (dict(dtype="int4", granularity="per_token", symmetric=False, group_size=48), "kv.group_size 48"),
    (dict(dtype="int8", granularity="per_head", group_size=32), "kv.group_size: group scales are per-token"),
    (dict(dtype="int4", granularity="per_token", symmetric=False, scale_dtype="e8m0"), "e8m0 .*zero point"),
])
def test_bad_formats_name_the_field(bad, match):
    with pytest.raises(UnsupportedError, match=match):
        KVFormat(**bad)
    with pytest.raises(UnsupportedError, match="does not divide head_dim 48"):
        KVFormat("int4", "per_token", False, group_size=32).groups(48)


@pytest.mark.parametrize("fmt", NEW, ids=lambda f: f.name)
def test_planner_bytes_equal_the_allocated_pool(fmt):
    cfg = PRESETS["llama3-8b"]
    blocks, bs = 3, 16
    layer = allocate_layer(fmt, blocks, bs, cfg.num_kv_heads, cfg.head_dim, "cpu")
    allocated = sum(t.numel() * t.element_size() for t in (layer.k, layer.v, layer.k_scale, layer.v_scale,
                                                          layer.k_zero, layer.v_zero) if t is not None)
    assert allocated == kv_bytes_per_token(cfg, fmt) / cfg.num_layers * blocks * bs


@pytest.mark.parametrize("fmt", [f for f in NEW if not f.split], ids=lambda f: f.name)
def test_group_round_trip_against_fp64(fmt):
    """Each group's round trip is within half a step of its own scale (fp64 check of the fp32 math), and a group
    with an outlier does not widen the other groups' scales."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 64, generator=gen, dtype=torch.float64)
    x[:, :, 5] = 50.0  # an outlier channel in the first group
    q, s, z = quantize_dynamic(x.float(), fmt)
    assert s.shape == (40, 3, 64 // fmt.group_size)
    back = dequantize(q, fmt, s, z).double()
    step = s.double().repeat_interleave(fmt.group_size, -1)
    err = (back - x).abs()
    if fmt.is_int:
        assert (err <= 0.5 * step * (1 + 1e-6) + 1e-30).all()
    else:  # fp8: relative rounding of the quotient, 2**-4 for e4m3, plus the subnormal floor
        assert (err <= x.abs() * 2**-4 + step * 2**-9 * (1 + 1e-6)).all()
    assert (s[..., 1:].double() < s[..., :1].double()).all()


def test_e8m0_scales_are_the_next_power_of_two():
    fmt = KVFormat("int4", "per_token", True, "e8m0", 32)
    x = torch.zeros(3, 1, 32)
    x[0, 0, 0], x[1, 0, 0], x[2, 0, 0] = 7.0, 7.5, 0.0  # amax / 7 = 1 exactly, just above 1, zero
    s, _ = dynamic_scales(x, fmt)
    assert s.dtype == torch.float8_e8m0fnu
    assert s.float().flatten().tolist() == [1.0, 2.0, 2.0**-126]


# ------------------------------------------------------------------------------------------------ recipes
def _recipe(**kv):
    from recipes.schema import Recipe

    return Recipe(name="t", model={"source": "synthetic", "preset": "llama3-8b"}, kv=kv)


def test_recipe_fields_and_format_name_give_one_format():
    by_fields = _recipe(granularity="per_token", k_dtype="int8", v_dtype="int4", v_symmetric=False)
    by_name = _recipe(format=K8V4.name)
    assert by_fields.kv_format() == by_name.kv_format() == K8V4
    again = type(by_fields).model_validate(by_fields.model_dump())
    assert again.kv_format() == K8V4
    assert _recipe(dtype="int4", granularity="per_token", symmetric=False, group_size=64).kv_format() == NEW[3]


def test_bundled_k8v4_recipes():
    from recipes import load_recipe

    k8v4_g32 = KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False, v_group_size=32)
    for name in ("smollm2-135m-k8v4kv", "llama3-8b-k8v4kv", "llama70b-k8v4kv"):
        r = load_recipe(name)
        assert r.kv_format() == k8v4_g32 and r.backend == "torch", name
        assert r.kv.rotation == "hadamard", name


@pytest.mark.parametrize("kv, match", [
    (dict(format=K8V4.name, dtype="int8"), "kv.format names the whole format; drop kv.dtype"),
    (dict(format="int9-per_token"), "unknown KV dtype 'int9'"),
    (dict(granularity="per_token", dtype="int4", symmetric=False, group_size=24), "group_size"),
])
def test_recipe_errors_name_the_field(kv, match):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match):
        _recipe(**kv)


def test_recipe_group_must_divide_the_models_head_dim():
    from pydantic import ValidationError

    from recipes.schema import Recipe

    with pytest.raises(ValidationError, match="kv.k_group_size: 128 does not divide the model's head_dim 64"):
        Recipe(name="t", model={"source": "builtin", "preset": "smollm2-135m"},
               kv={"granularity": "per_token", "dtype": "int4", "symmetric": False, "group_size": 128})


@pytest.mark.parametrize("kv, match", [
    (dict(granularity="per_token", k_dtype="int8", v_dtype="int4", v_symmetric=False),
     r"TensorRT-LLM stores K and V in one KV cache dtype.*supports fp16, bf16, int8 per_tensor, fp8_e4m3 "
     r"per_tensor.*backend: torch"),
    (dict(granularity="per_token", dtype="int8", group_size=32),
     r"kv.group_size: TensorRT-LLM keeps one KV scale per layer.*supports fp16, bf16, int8 per_tensor"),
])
def test_tensorrt_llm_rejects_with_the_alternatives(kv, match):
    from pydantic import ValidationError

    from recipes.schema import Recipe

    with pytest.raises(ValidationError, match=match):
        Recipe(name="t", backend="tensorrt-llm", model={"source": "synthetic", "preset": "llama3-8b"}, kv=kv)


@pytest.mark.parametrize("fmt", NEW, ids=lambda f: f.name)
def test_reference_write_then_read_gives_each_sides_round_trip(fmt):
    """runtime/attention.py's write_kv / read_kv (the CPU engine's path) store each side in its own format (e8m0
    scales included, which torch cannot index_put)."""
    from runtime import attention

    gen = torch.Generator().manual_seed(1)
    cache = allocate_layer(fmt, 4, 5, 2, 64, "cpu")
    k, v = torch.randn(7, 2, 64, generator=gen), torch.randn(7, 2, 64, generator=gen)
    slots = torch.tensor([0, 3, 7, 12, 19, 5, 6])
    attention.write_kv(cache, k, v, slots)
    got = attention.read_kv(cache, slots, torch.float32)
    for side, x, back in ((fmt.k, k, got[0]), (fmt.v, v, got[1])):
        q, s, z = quantize_dynamic(x, side)
        assert torch.equal(back, dequantize(q, side, s, z))
