"""The step's fused small ops (runtime/kernels/small_ops.py) bit for bit against the roundings of the torch ops
they replace, written out step by step (compute in fp32, round to the dtype where torch rounds, torch's order), so
the interpreter on the CPU checks the bits the GPU must give; on CUDA also against the torch ops themselves; and
against an fp64 oracle. Odd shapes: rows that are not powers of two."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_kernels import CUDA, DEV

from runtime.config import PRESETS
from runtime.kernels.small_ops import add_rms_norm, rms_norm, rope_qk, swiglu
from runtime.rope import Rotary, apply_rotary

DTYPES = [torch.bfloat16, torch.float16]


def _ulps(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|x - ref| in units of the dtype's spacing at |ref| (the oracle's tolerance unit)."""
    eps = torch.finfo(x.dtype).eps
    tiny = torch.finfo(x.dtype).tiny
    return (x.double() - ref).abs() / (ref.abs() * eps).clamp_min(tiny)


def _torch_rms_norm(x, w, eps):  # the CPU model's norm (model.LlamaModel._rms_norm for 16-bit dtypes)
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _stepwise_rms_norm(x, w, eps):
    """The kernel's roundings: the sum of squares and the inverse root in fp64, rounded once to fp32; x times it
    rounded to the dtype; times the weight, rounded."""
    xf = x.float().cpu()
    xd = xf.double()
    inv = (1.0 / torch.sqrt(xd.pow(2).sum(-1, keepdim=True) / x.shape[-1] + torch.tensor(eps).float().double())).float()
    normed = (xf * inv).to(x.dtype)
    return (w.float().cpu() * normed.float()).to(x.dtype)


def _device_exp(x: torch.Tensor) -> torch.Tensor:
    """fp32 exp as the kernel's device computes it: CUDA's accurate expf (torch's and libdevice's), or numpy's
    under the interpreter."""
    return torch.exp(x) if x.is_cuda else torch.from_numpy(np.exp(x.numpy()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 96), (5, 200), (3, 1000)])
def test_add_rms_norm_is_the_unfused_norm_bit_for_bit(dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    h = (torch.randn(rows, n, generator=gen) * 3).to(dtype).to(DEV)
    delta = torch.randn(rows, n, generator=gen).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype).to(DEV)
    eps = 1e-5
    out_h, normed = add_rms_norm(h, delta, w, eps)
    assert torch.equal(out_h, h + delta)  # one rounding of the sum, as torch's add
    # fused == unfused: the add, then the norm the CUDA model runs alone (one reduction serves both)
    assert torch.equal(normed, rms_norm(h + delta, w, eps))
    assert torch.equal(normed.cpu(), _stepwise_rms_norm(out_h, w, eps))
    same_h, normed_only = add_rms_norm(h, None, w, eps)
    assert same_h is h and torch.equal(normed_only.cpu(), _stepwise_rms_norm(h, w, eps))
    assert torch.equal(rms_norm(h.view(1, rows, n), w, eps), normed_only.view(1, rows, n))  # dense callers' 3-d h
    s = h.double() + delta.double()
    ref = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    # the sum's rounding, the norm's and the weight product's: at most ~3 roundings of the dtype
    assert _ulps(normed, ref).max() <= 3.0
    # what changed against the old torch-only norm (fp32 mean and rsqrt): last-bit differences only
    assert _ulps(normed, _torch_rms_norm(out_h, w, eps).double()).max() <= 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", ["tiny-llama3", "smollm2-135m"])
def test_rope_qk_is_apply_rotary_bit_for_bit(dtype, cfg):
    c = PRESETS[cfg]
    gen = torch.Generator().manual_seed(0)
    t = 7
    qkv = torch.randn(t, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, generator=gen).to(dtype).to(DEV)
    positions = torch.tensor([0, 1, 5, 63, 64, 300, 1000])[:t].to(DEV)
    rot = Rotary(c)
    cos_t, sin_t = rot.table(torch.device(DEV), 1024)
    q, k = rope_qk(qkv, cos_t, sin_t, positions, c.num_heads, c.num_kv_heads, c.head_dim)
    heads = c.num_heads + c.num_kv_heads
    x = qkv[:, : heads * c.head_dim].view(t, heads, c.head_dim)
    cos, sin = rot.cos_sin(positions, dtype, 1023)
    assert q.is_contiguous() and k.is_contiguous()
    got = torch.cat((q, k), 1)
    assert torch.equal(got, apply_rotary(x, cos, sin))
    # torch's roundings step by step: every product and the sum rounded to the dtype (no fused multiply-add)
    r = lambda v: v.to(dtype).float()  # noqa: E731
    half = c.head_dim // 2
    xf, cf, sf = x.float().cpu(), r(cos_t[positions].cpu())[:, None], r(sin_t[positions].cpu())[:, None]
    x1, x2 = xf[..., :half], xf[..., half:]
    lo = r(r(x1 * cf[..., :half]) + r(-x2 * sf[..., :half]))
    hi = r(r(x2 * cf[..., half:]) + r(x1 * sf[..., half:]))
    assert torch.equal(got.cpu(), torch.cat((lo, hi), -1).to(dtype))
    # and the rotation itself, in fp64
    cd, sd = cos_t[positions].double()[:, None], sin_t[positions].double()[:, None]
    ref = x.double() * cd + torch.cat((-x[..., half:], x[..., :half]), -1).double() * sd
    err = (got.double() - ref).abs()
    assert err.max() <= 4 * torch.finfo(dtype).eps * ref.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 256), (3, 1500)])
def test_swiglu_is_silu_times_up_bit_for_bit(dtype, rows, n):
    gen = torch.Generator().manual_seed(n)
    gu = (torch.randn(rows, 2 * n, generator=gen) * 4).to(dtype).to(DEV)
    out = swiglu(gu)
    gate, up = gu.chunk(2, -1)
    # torch's CUDA silu step by step: g / (1 + exp(-g)) in fp32, rounded; times up in fp32, rounded
    g = gate.float()
    act = (g / (1.0 + _device_exp(-g))).to(dtype)
    assert torch.equal(out, (act.float() * up.float()).to(dtype))
    if CUDA:
        assert torch.equal(out, F.silu(gate) * up)
    else:  # the CPU's torch exp is not numpy's: an fp32 ulp of exp may move a value by one rounding
        assert _ulps(out, (F.silu(gate) * up).double()).max() <= 1.0
    gd, ud = gu.double().chunk(2, -1)
    ref = gd * torch.sigmoid(gd) * ud
    assert _ulps(out, ref)[ref.abs() > 1e-3].max() <= 2.5  # silu's rounding and the product's


def test_empty_inputs():
    w = torch.ones(8, dtype=torch.bfloat16, device=DEV)
    h = torch.empty(0, 8, dtype=torch.bfloat16, device=DEV)
    assert add_rms_norm(h, h, w, 1e-5)[1].shape == (0, 8) and swiglu(torch.empty(0, 16, device=DEV)).shape == (0, 8)


def test_the_model_with_small_ops_gives_the_torch_paths_tokens(tmp_path_factory):
    """LlamaModel.forward_paged through the fused small ops: the greedy tokens of torch's ops (a tiny bf16 Llama,
    prefill and decode, the reference attention)."""
    import types

    from helpers_runtime import tiny_llama_dir

    from runtime.engine import Engine
    from runtime.kernels import small_ops

    eng = Engine.from_dir(tiny_llama_dir(tmp_path_factory), device=DEV, dtype="bfloat16", num_blocks=64,
                          block_size=8, batch_invariant=False, attention="reference", cuda_graphs=False,
                          burst_steps=0, fused_ops=False)  # torch's ops first, every step through the runner
    prompts = [[(5 * i + 11 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([4, 11])]
    calls = []

    def counted(fn):
        return lambda *a: calls.append(fn.__name__) or fn(*a)

    ops = types.SimpleNamespace(**{n: counted(getattr(small_ops, n)) for n in ("add_rms_norm", "rope_qk", "swiglu")})
    try:
        want = [g.token_ids for g in eng.generate(prompts, max_tokens=6, ignore_eos=True)]
        eng.runner.backend = types.SimpleNamespace(**vars(eng.backend), small_ops=ops)
        got = [g.token_ids for g in eng.generate(prompts, max_tokens=6, ignore_eos=True)]
    finally:
        eng.shutdown()
    assert got == want
    # 6 forwards (one prefill, 5 decode steps) of 2 layers: 1 + 2 * 2 norms, 2 RoPEs, 2 SwiGLUs each
    assert calls.count("add_rms_norm") == 6 * 5 and calls.count("rope_qk") == calls.count("swiglu") == 6 * 2


@pytest.mark.slow
def test_fused_bursts_store_the_legacy_steps_fp8_codes(tmp_path_factory, fmt="fp8_e4m3-per_tensor"):
    """A tiny Llama through the Triton KV kernels, FP8 caches: decode bursts through the fused small ops write the
    K/V codes of the legacy step's torch ops, byte for byte in every layer, and give its tokens. The norms of both
    paths run the one kernel, as on CUDA (model.LlamaModel._rms_norm); the RoPE, SwiGLU and residual adds are the
    fused ones against torch's. (~50 s under the interpreter: one format; the plans of every fp8 format are
    tests/test_decode_burst.py's.)"""
    import types

    from helpers_runtime import tiny_llama_dir

    import runtime.kernels as kernels
    from runtime.decode_burst import DecodeBurst
    from runtime.engine import Engine
    from runtime.kernels import small_ops

    d = tiny_llama_dir(tmp_path_factory)
    prompts = [[(5 * i + 11 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([9, 21])]
    scales = {"k_scale": torch.full((2,), 0.02), "v_scale": torch.full((2,), 0.02)} if "per_tensor" in fmt else None

    def run(fused: bool):
        eng = Engine.from_dir(d, device=DEV, dtype="bfloat16", kv_format=fmt, kv_scales=scales, num_blocks=32,
                              block_size=8, batch_invariant=False, cuda_graphs=False, burst_steps=0, fused_ops=False)
        triton_ops = {n: getattr(kernels, n, None) or getattr(eng.backend, n) for n in
                      ("write_kv", "decode_attention", "prefill_attention", "prefill_context_attention")}
        eng.backend = eng.runner.backend = types.SimpleNamespace(name="triton", **triton_ops)
        eng.model._rms_norm = lambda x, w: rms_norm(x, w, eng.cfg.rms_norm_eps)
        if fused:
            ops = types.SimpleNamespace(**vars(eng.backend), small_ops=small_ops)
            eng.steps.burst = DecodeBurst(eng.model, eng.runner.caches, ops, 8, eng.max_seq_len, 8, 4, use_graphs=False)
        try:
            tokens = [g.token_ids for g in eng.generate(prompts, max_tokens=6, ignore_eos=True)]
            assert not fused or eng.steps.burst.steps_run == 5
            return tokens, [(c.k.view(torch.uint8).clone(), c.v.view(torch.uint8).clone()) for c in eng.runner.caches]
        finally:
            eng.shutdown()

    (want, want_kv), (got, got_kv) = run(False), run(True)
    assert got == want
    for (k, v), (k0, v0) in zip(got_kv, want_kv):
        assert torch.equal(k, k0) and torch.equal(v, v0)
