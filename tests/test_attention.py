"""The reference attention ops (the oracle the Triton kernels are checked against)
against plain fp64 attention, with pages drawn out of order and odd lengths."""

from __future__ import annotations

import pytest
import torch

from runtime.attention import decode_attention, prefill_attention, prefill_context_attention, write_kv
from runtime.kv_cache import allocate_layer
from runtime.kv_format import KVFormat
from runtime.kv_quant import dequantize, quantize, quantize_dynamic, static_scale_from_amax

H, G, D, BS = 2, 3, 16, 4  # kv heads, query heads per kv head, head dim, block size
LENS = [5, 1, 13, 8]


def _dense_attention(q, k, v, scale, causal=False):
    """fp64 softmax(q k^T) v for one sequence: q [n, H*G, D], k/v [L, H, D]; GQA by repeat."""
    k = k.double().repeat_interleave(G, dim=1).transpose(0, 1)
    v = v.double().repeat_interleave(G, dim=1).transpose(0, 1)
    s = torch.matmul(q.double().transpose(0, 1), k.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v).transpose(0, 1)


def _roundtrip(x, fmt, scale):
    """What the cache holds for x, via the (separately tested) format functions."""
    if fmt.dynamic:
        q, s, z = quantize_dynamic(x, fmt)
        return dequantize(q, fmt, s, z)
    if fmt.static:
        return dequantize(quantize(x, fmt, scale), fmt, scale)
    return x.to(fmt.storage_dtype).float()


FORMATS = [KVFormat("fp32"), KVFormat("fp16"), KVFormat("int8", "per_head"), KVFormat("int4", "per_tensor"),
           KVFormat("fp8_e4m3", "per_head"), KVFormat("int4", "per_token", False), KVFormat("fp8_e5m2", "per_token")]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_paged_decode_matches_dense_fp64(fmt):
    g = torch.Generator().manual_seed(0)
    num_blocks = 16
    ks = [torch.randn(n, H, D, generator=g) * 2 for n in LENS]
    vs = [torch.randn(n, H, D, generator=g) for n in LENS]
    k_scale = v_scale = None
    if fmt.static:
        amax = torch.stack([k.abs().amax(dim=(0, 2)) for k in ks + vs]).amax(0)
        k_scale = v_scale = static_scale_from_amax(amax if fmt.granularity == "per_head" else amax.max(), fmt)
    cache = allocate_layer(fmt, num_blocks, BS, H, D, "cpu", k_scale, v_scale)
    pages = torch.randperm(num_blocks, generator=g).tolist()  # sequences' pages out of order
    tables = []
    for k, v in zip(ks, vs):
        nb = -(-len(k) // BS)
        table, pages = pages[:nb], pages[nb:]
        tables.append(table)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(len(k))])
        write_kv(cache, k, v, slots)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(LENS), H * G, D, generator=g)
    out = decode_attention(q, cache, bt, torch.tensor(LENS, dtype=torch.int32), D**-0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    for b, (k, v) in enumerate(zip(ks, vs)):
        ref = _dense_attention(q[b : b + 1], _roundtrip(k, fmt, k_scale), _roundtrip(v, fmt, v_scale), D**-0.5)[0]
        err = (out[b].double() - ref).abs().max().item()
        assert err <= 1e-5, (b, err)


def test_prefill_is_causal_per_sequence_with_gqa():
    g = torch.Generator().manual_seed(1)
    lens = [7, 1, 12]
    t = sum(lens)
    q = torch.randn(t, H * G, D, generator=g)
    k = torch.randn(t, H, D, generator=g)
    v = torch.randn(t, H, D, generator=g)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    out = prefill_attention(q, k, v, cu, 0.3)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = _dense_attention(q[a:b], k[a:b], v[a:b], 0.3, causal=True)
        assert (out[a:b].double() - ref).abs().max().item() <= 1e-5


def test_decode_probability_rounding_matches_rounded_fp64():
    """p_dtype rounds the softmax output before p . V, exactly as computed by hand in fp64."""
    g = torch.Generator().manual_seed(3)
    fmt = KVFormat("fp32")
    cache = allocate_layer(fmt, 4, BS, H, D, "cpu")
    k, v = torch.randn(7, H, D, generator=g) * 3, torch.randn(7, H, D, generator=g)
    write_kv(cache, k, v, torch.arange(7))
    bt, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    q = torch.randn(1, H * G, D, generator=g)
    plain = decode_attention(q, cache, bt, lens, D**-0.5)
    rounded = decode_attention(q, cache, bt, lens, D**-0.5, p_dtype=torch.bfloat16)
    kr = k.double().repeat_interleave(G, dim=1).transpose(0, 1)  # [H*G, L, D]
    vr = v.double().repeat_interleave(G, dim=1).transpose(0, 1)
    p = torch.softmax(q[0].double()[:, None, :] @ kr.transpose(-1, -2) * D**-0.5, -1)  # [H*G, 1, L]
    want = (p.to(torch.bfloat16).double() @ vr)[:, 0]
    assert (rounded[0].double() - want).abs().max() <= 1e-5
    # bf16 probabilities (8 significant bits) move the output by far more than fp32 rounding
    assert (rounded - plain).abs().max() > 1e-4


@pytest.mark.parametrize("fmt", [KVFormat("fp32"), KVFormat("int8", "per_token"), KVFormat("fp8_e4m3", "per_head")],
                         ids=lambda f: f.name)
def test_prefill_context_attention_matches_fp64(fmt):
    """Chunked prefill: each chunk attends to its sequence's cached context (dequantized, as
    decode reads it) and causally to its own K/V in full precision. Contexts of 0, a page and a
    half, and 9 tokens; pages out of order."""
    g = torch.Generator().manual_seed(4)
    ctx, chunk = [0, 6, 9], [5, 3, 7]
    full = [torch.randn(c + n, H, D, generator=g) * 2 for c, n in zip(ctx, chunk)], \
        [torch.randn(c + n, H, D, generator=g) for c, n in zip(ctx, chunk)]
    k_scale = v_scale = None
    if fmt.static:
        amax = torch.stack([x.abs().amax(dim=(0, 2)) for x in full[0] + full[1]]).amax(0)
        k_scale = v_scale = static_scale_from_amax(amax, fmt)
    cache = allocate_layer(fmt, 16, BS, H, D, "cpu", k_scale, v_scale)
    pages = torch.randperm(16, generator=g).tolist()
    tables = []
    for c, k, v in zip(ctx, *full):
        nb = -(-len(k) // BS)
        table, pages = pages[:nb], pages[nb:]
        tables.append(table)
        write_kv(cache, k[:c], v[:c], torch.tensor([table[p // BS] * BS + p % BS for p in range(c)], dtype=torch.long))
    bt = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(chunk), H * G, D, generator=g)
    k_new = torch.cat([k[c:] for c, k in zip(ctx, full[0])])
    v_new = torch.cat([v[c:] for c, v in zip(ctx, full[1])])
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    out = prefill_context_attention(q, k_new, v_new, cu, cache, bt, torch.tensor(ctx, dtype=torch.int32), 0.3)
    for i, (c, k, v) in enumerate(zip(ctx, *full)):
        a, b = cu[i].item(), cu[i + 1].item()
        keys = torch.cat((_roundtrip(k[:c], fmt, k_scale), k[c:]))  # cached context, then the chunk as computed
        vals = torch.cat((_roundtrip(v[:c], fmt, v_scale), v[c:]))
        for j in range(b - a):  # query j sees positions 0 .. c + j
            ref = _dense_attention(q[a + j : a + j + 1], keys[: c + j + 1], vals[: c + j + 1], 0.3)[0]
            assert (out[a + j].double() - ref).abs().max().item() <= 1e-5, (i, j)
    # no context anywhere: the same as prefill_attention
    none = torch.zeros(3, dtype=torch.int32)
    assert torch.equal(prefill_context_attention(q, k_new, v_new, cu, cache, bt, none, 0.3),
                       prefill_attention(q, k_new, v_new, cu, 0.3))
