"""The screening rules of benchmarks/kv_screen.py: each stores what its docstring says."""

from __future__ import annotations

import torch

from benchmarks.kv_screen import MSE_ALPHAS, NF4, ScreenRoundTrip, rule_for
from runtime.kv_format import KVFormat
from runtime.kv_quant import dequantize, quantize, quantize_dynamic, round_up_to


def _x(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(70, 3, 64, generator=g, dtype=torch.float64)
    x[:, :, 5] *= 8  # an outlier channel, as SmolLM2's keys have
    return x.float()


def test_nf4_values_are_levels_times_the_groups_absmax():
    x = _x()
    y = rule_for("nf4-g32")(x).double().unflatten(-1, (2, 32))
    amax = x.double().unflatten(-1, (2, 32)).abs().amax(-1, keepdim=True)
    ratio = y / amax
    # every value is one of the 16 levels (the fp16 absmax is rounded up by at most 2**-10 relative)
    nearest = (ratio.unsqueeze(-1) - NF4.double()).abs().amin(-1)
    assert float(nearest.max()) < 2e-3
    assert len(NF4) == 16 and float(NF4.min()) == -1.0 and float(NF4.max()) == 1.0 and 0.0 in NF4.tolist()


def test_clip_search_is_never_worse_than_the_plain_scale():
    x = _x(1)
    fmt = KVFormat("int4", "per_token", True, "float16", 32)
    q, s, z = quantize_dynamic(x, fmt)
    plain = (dequantize(q, fmt, s, z).double() - x.double()).pow(2).unflatten(-1, (2, 32)).sum(-1)
    clip = (rule_for("clip-g32")(x).double() - x.double()).pow(2).unflatten(-1, (2, 32)).sum(-1)
    assert bool((clip <= plain + 1e-9).all()) and float(clip.sum()) < float(plain.sum())


def test_kivi_keys_are_per_channel_over_32_tokens_with_an_unquantized_tail():
    x = _x(2)
    y = rule_for("kivi")(x)
    assert torch.equal(y[64:], x[64:])  # 70 = 2 x 32 + 6: the last 6 tokens are the residual window
    g = x[:64].double().unflatten(0, (2, 32))
    step = (g.amax(1, keepdim=True) - g.amin(1, keepdim=True)) / 15
    err = (y[:64].double().unflatten(0, (2, 32)) - g).abs()
    assert bool((err <= step * (0.5 + 2e-3) + 1e-3).all())


def test_sink_tokens_are_kept_at_int8():
    x = _x(3)
    k, v = ScreenRoundTrip("int4-per_token-asym", "int4-per_token-asym", sink=4)(0, x, x)
    step8 = x[:4].double().abs().amax(-1, keepdim=True) / 127
    assert bool(((k[:4].double() - x[:4].double()).abs() <= step8 * 0.51).all())
    fmt = KVFormat("int4", "per_token", False)
    q, s, z = quantize_dynamic(x[4:], fmt)
    assert torch.equal(v[4:], dequantize(q, fmt, s, z))


def test_error_minimising_fp8_scale_is_never_worse_and_stays_on_the_fp8_grid():
    x = _x(4)
    for g in (0, 32):
        fmt = KVFormat("fp8_e4m3", "per_token", True, "float16", g)
        q, s, _ = quantize_dynamic(x, fmt)
        shape = (-1, g) if g else (-1, 64)
        plain = (dequantize(q, fmt, s).double() - x.double()).pow(2).reshape(*x.shape[:-1], *shape).sum(-1)
        y = rule_for(f"mse:{fmt.name}")(x)
        best = (y.double() - x.double()).pow(2).reshape(*x.shape[:-1], *shape).sum(-1)
        assert bool((best <= plain + 1e-12).all()) and float(best.sum()) < float(plain.sum())
        # each token-head (group) holds one candidate scale's round trip, whole
        yg = y.reshape(*x.shape[:-1], *shape)
        hit = torch.zeros(yg.shape[:-1], dtype=torch.bool)
        for a in MSE_ALPHAS:
            sa = round_up_to(s.float() * a, torch.float16)
            ca = dequantize(quantize(x, fmt, sa), fmt, sa).reshape(yg.shape)
            hit |= (ca == yg).all(-1)
        assert bool(hit.all())


def test_two_bit_rules_stay_within_half_a_step_of_their_groups():
    x = _x(5)
    y = rule_for("asym-b2-g32")(x).double().unflatten(-1, (2, 32))
    g = x.double().unflatten(-1, (2, 32))
    step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 3  # 4 levels
    assert bool(((y - g).abs() <= step * (0.5 + 2e-3) + 1e-3).all())
    assert len(torch.unique(y[0, 0, 0])) <= 4
    k = rule_for("kivi-t64-b2")(x).double()
    assert torch.equal(k[64:], x[64:].double())
    kg = x[:64].double()
    kstep = (kg.amax(0) - kg.amin(0)) / 3
    assert bool(((k[:64] - kg).abs() <= kstep * (0.5 + 2e-3) + 1e-3).all())


def test_a_layer_range_takes_the_rule_and_the_other_layers_the_rest():
    x = _x(6)
    rest = ScreenRoundTrip("int8-per_token", "int8-per_token")
    rt = ScreenRoundTrip("asym-b2-g32", "asym-b2-g32", layers=range(2, 4), rest=rest)
    two = rule_for("asym-b2-g32")(x)
    for layer in range(5):
        k, v = rt(layer, x, x)
        expect = two if layer in (2, 3) else rest(layer, x, x)[0]
        assert torch.equal(k, expect) and torch.equal(v, expect)
