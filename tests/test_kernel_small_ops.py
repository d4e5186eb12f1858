"""The step's fused small ops (runtime/kernels/small_ops.py) against an fp64 oracle and against the torch ops
of model.py they replace: RoPE and the residual add bit for bit, RMSNorm and SwiGLU within one rounding of the
dtype (the kernels reduce and exponentiate in another order). Odd shapes: rows that are not powers of two."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_kernels import DEV

from runtime.config import PRESETS
from runtime.kernels.small_ops import add_rms_norm, rope_qk, swiglu
from runtime.rope import Rotary, apply_rotary

DTYPES = [torch.bfloat16, torch.float16]


def _ulps(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|x - ref| in units of the dtype's spacing at |ref| (the oracle's tolerance unit)."""
    eps = torch.finfo(x.dtype).eps
    tiny = torch.finfo(x.dtype).tiny
    return (x.double() - ref).abs() / (ref.abs() * eps).clamp_min(tiny)


def _torch_rms_norm(x, w, eps):  # model.LlamaModel._rms_norm for 16-bit dtypes
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 96), (5, 200), (3, 1000)])
def test_add_rms_norm_matches_fp64_and_the_torch_norm(dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    h = (torch.randn(rows, n, generator=gen) * 3).to(dtype).to(DEV)
    delta = torch.randn(rows, n, generator=gen).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype).to(DEV)
    eps = 1e-5
    out_h, normed = add_rms_norm(h, delta, w, eps)
    assert torch.equal(out_h, h + delta)  # one rounding of the sum, as torch's add
    s = h.double() + delta.double()
    ref = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    # the sum's rounding, the norm's and the weight product's: at most ~3 roundings of the dtype
    assert _ulps(normed, ref).max() <= 3.0
    torch_normed = _torch_rms_norm(out_h, w, eps)
    assert _ulps(normed, torch_normed.double()).max() <= 1.0  # torch's own: last-bit differences only
    same_h, normed_only = add_rms_norm(h, None, w, eps)
    assert same_h is h and _ulps(normed_only, _torch_rms_norm(h, w, eps).double()).max() <= 1.0


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
    cos, sin = rot.cos_sin(positions, dtype, 1023)
    want = apply_rotary(qkv[:, : heads * c.head_dim].view(t, heads, c.head_dim), cos, sin)
    assert q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, want[:, : c.num_heads]) and torch.equal(k, want[:, c.num_heads:])
    # and the rotation itself, in fp64
    x = qkv[:, : heads * c.head_dim].view(t, heads, c.head_dim).double()
    half = c.head_dim // 2
    cd, sd = cos_t[positions].double()[:, None], sin_t[positions].double()[:, None]
    ref = x * cd + torch.cat((-x[..., half:], x[..., :half]), -1) * sd
    err = (torch.cat((q, k), 1).double() - ref).abs()
    assert err.max() <= 4 * torch.finfo(dtype).eps * ref.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 256), (3, 1500)])
def test_swiglu_matches_fp64_and_torch(dtype, rows, n):
    gen = torch.Generator().manual_seed(n)
    gu = (torch.randn(rows, 2 * n, generator=gen) * 4).to(dtype).to(DEV)
    out = swiglu(gu)
    g, u = gu.double().chunk(2, -1)
    ref = g * torch.sigmoid(g) * u
    assert _ulps(out, ref)[ref.abs() > 1e-3].max() <= 2.5  # silu's rounding and the product's
    gate, up = gu.chunk(2, -1)
    assert _ulps(out, (F.silu(gate) * up).double())[ref.abs() > 1e-3].max() <= 1.0


def test_empty_inputs():
    w = torch.ones(8, dtype=torch.bfloat16, device=DEV)
    h = torch.empty(0, 8, dtype=torch.bfloat16, device=DEV)
    assert add_rms_norm(h, h, w, 1e-5)[1].shape == (0, 8) and swiglu(torch.empty(0, 16, device=DEV)).shape == (0, 8)


def test_the_model_with_small_ops_gives_the_torch_paths_tokens(tmp_path_factory):
    """LlamaModel.forward_paged through the fused small ops: the same greedy tokens, logits within the
    last-bit differences of the norms (a tiny bf16 Llama, prefill and decode, the reference attention)."""
    import types

    from helpers_runtime import tiny_llama_dir

    from runtime.engine import Engine
    from runtime.kernels import small_ops

    eng = Engine.from_dir(tiny_llama_dir(tmp_path_factory), device=DEV, dtype="bfloat16", num_blocks=64,
                          block_size=8, batch_invariant=False, attention="reference", cuda_graphs=False)
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
