"""The chunked-prefill kernel (runtime/kernels/prefill_context.py) against an fp64 attention
and against the reference op it replaces (runtime.attention.prefill_context_attention).

On a CPU machine the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set
before the kernels are imported) at small, odd shapes; on a CUDA machine the same tests
compile it and add the Llama-3-8B attention shape.

Oracle (shared/reference/style.md): the kernel's error against fp64 attention over the same
stored bytes (dequantized with kv_quant.dequantize) and the chunk's own K/V, under the
bottom-right causal mask, is at most 2x the error of plain PyTorch attention at q's precision
plus a small floor. Chunks of several lengths (one without context, one empty, none a
multiple of the tile), contexts that are not multiples of the page, pages drawn from
randperm with unowned pages between them, a GQA group of 3.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import replace

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from runtime import attention as ref_ops  # noqa: E402
from runtime.kernels import prefill_context_attention, prefill_plan  # noqa: E402
from runtime.kv_cache import allocate_layer  # noqa: E402
from runtime.kv_format import KVFormat  # noqa: E402
from runtime.kv_quant import dequantize  # noqa: E402

DEV = "cuda" if CUDA else "cpu"

# Every format family: unquantized, fp8 static, int8 static and per-token asymmetric,
# int4 (two values a byte) static and per-token, symmetric and asymmetric.
FORMATS = [
    KVFormat("fp32"),
    KVFormat("bf16"),
    KVFormat("fp8_e4m3", "per_tensor"),
    KVFormat("fp8_e5m2", "per_token", scale_dtype="bfloat16"),
    KVFormat("int8", "per_head"),
    KVFormat("int8", "per_token", symmetric=False),
    KVFormat("int4", "per_head"),
    KVFormat("int4", "per_token"),
    KVFormat("int4", "per_token", symmetric=False),
]
FMT_IDS = [f.name for f in FORMATS]

# heads, kv heads, head_dim, page size, chunks as (context, chunk length), tiles (block_m rows, block_n).
# gqa3: 16 rows = 5 tokens x 3 heads, so chunks of 7 and 11 end inside a tile; page 5.
# gqa2: 32 rows = 16 tokens x 2 heads: the 20-token chunk is a tile and a quarter.
SHAPES = {
    "gqa3-page5": dict(heads=9, kv_heads=3, head_dim=16, block_size=5, chunks=[(17, 7), (0, 5), (12, 0), (23, 11)],
                       tiles=dict(block_m=16, block_n=16)),
    "gqa2-page16": dict(heads=4, kv_heads=2, head_dim=32, block_size=16, chunks=[(40, 20), (0, 3), (33, 1)],
                        tiles=dict(block_m=32, block_n=16)),
}
if CUDA:  # Llama-3-8B attention: a 512-token chunk after 4096 cached tokens, the launcher's own tiles
    SHAPES["llama8b"] = dict(heads=32, kv_heads=8, head_dim=128, block_size=16,
                             chunks=[(4096, 512), (1000, 300), (0, 77)], tiles={})


def _relerr(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def _build(fmt, s, gen, qdtype, v_per_token=False):
    """The op's arguments (q, k, v, cu_seqlens, cache, block_tables, context_lens): a paged cache
    holding each chunk's context (and, as the engine writes it before attending, the chunk
    itself) and the step's packed q/k/v. v_per_token: every (token, KV head) of V gets its own
    magnitude (2^-6 .. 2^6) and offset (up to 4x that), so per-token scales and zero points
    differ strongly from token to token."""
    kvh, d, bs = s["kv_heads"], s["head_dim"], s["block_size"]
    pages = [math.ceil((c + n) / bs) for c, n in s["chunks"]]
    num_blocks = sum(pages) + 4  # unowned pages between the owned ones, full of junk
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.full((len(pages), max(pages)), num_blocks - 1, dtype=torch.int32)  # padding: some other page
    seqs, used = [], 0
    for i, ((c, n), p) in enumerate(zip(s["chunks"], pages)):
        bt[i, :p] = perm[used:used + p].to(torch.int32)
        used += p
        k = torch.randn(c + n, kvh, d, generator=gen) * 2.0
        k[:, :, 1] += 4.0  # an outlier channel, as real keys have
        v = torch.randn(c + n, kvh, d, generator=gen)
        if v_per_token:
            mag = 2.0 ** (12 * torch.rand(c + n, kvh, 1, generator=gen) - 6)
            v = (v + 4 * (2 * torch.rand(c + n, kvh, 1, generator=gen) - 1)) * mag
        seqs.append((k.to(qdtype), v.to(qdtype)))
    ks = vs = None
    if fmt.static:
        amax = [torch.cat([x[w] for x in seqs]).float().abs().amax((0, 2)) for w in (0, 1)]
        ks, vs = ((a.max() if fmt.granularity == "per_tensor" else a) / fmt.qmax for a in amax)
    cache = allocate_layer(fmt, num_blocks, bs, kvh, d, DEV, ks, vs)
    for t in (cache.k, cache.v):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen))
    for t in (cache.k_scale, cache.v_scale) if fmt.dynamic else ():
        t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
    for i, (k, v) in enumerate(seqs):  # the reference write (runtime.attention), not the write kernel
        pos = torch.arange(len(k))
        slots = bt[i, pos // bs].long() * bs + pos % bs
        ref_ops.write_kv(cache, k.float().to(DEV), v.float().to(DEV), slots.to(DEV))
    lens = [n for _, n in s["chunks"]]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lens), s["heads"], d, generator=gen).to(qdtype)
    k_new = torch.cat([k[c:] for (c, _), (k, _) in zip(s["chunks"], seqs)])
    v_new = torch.cat([v[c:] for (c, _), (_, v) in zip(s["chunks"], seqs)])
    ctx = torch.tensor([c for c, _ in s["chunks"]], dtype=torch.int32)
    return [t.to(DEV) for t in (q, k_new, v_new, cu)] + [cache, bt.to(DEV), ctx.to(DEV)]


def _gather(cache, name, blocks, offs, dtype):
    """Cached tokens [L, kv_heads, head_dim] dequantized by kv_format (in fp32, then `dtype`)."""
    x, fmt = getattr(cache, name)[blocks, :, offs], cache.fmt.side(name)
    if fmt.dynamic:
        z = getattr(cache, f"{name}_zero")
        return dequantize(x, fmt, getattr(cache, f"{name}_scale")[blocks, :, offs],
                          None if z is None else z[blocks, :, offs], dtype)
    return dequantize(x, fmt, getattr(cache, f"{name}_scale"), dtype=dtype)


def _attention(args, sm_scale, dtype):
    """Per chunk: the cached context (dequantized) then the chunk's own K/V, query t seeing keys
    0 .. context + t. fp64 = the truth; q's dtype = plain PyTorch at that precision."""
    q, k_new, v_new, cu, cache, bt, ctx = args
    group = q.shape[1] // cache.kv_heads
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for i, (a, b, c) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), ctx.tolist())):
        if a == b:
            continue
        t = torch.arange(c, device=q.device)
        blocks, offs = bt[i, t // cache.block_size].long(), t % cache.block_size
        keys = torch.cat((_gather(cache, "k", blocks, offs, dtype), k_new[a:b].to(dtype)))
        vals = torch.cat((_gather(cache, "v", blocks, offs, dtype), v_new[a:b].to(dtype)))
        keys, vals = (x.repeat_interleave(group, 1).transpose(0, 1) for x in (keys, vals))  # [heads, L, D]
        scores = (q[a:b].to(dtype).transpose(0, 1) @ keys.transpose(1, 2)).to(soft) * sm_scale  # [heads, n, L]
        pos = torch.arange(c + b - a, device=q.device)
        visible = pos[None, :] <= c + pos[:b - a, None]
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).to(dtype)
        out[a:b] = (p @ vals).transpose(0, 1)
    return out


def _check(out, args, sm_scale, qdtype):
    """The relative oracle; returns (fp64 truth, PyTorch's error at q's precision)."""
    truth = _attention(args, sm_scale, torch.float64)
    torch_err = _relerr(_attention(args, sm_scale, qdtype), truth)
    err = _relerr(out, truth)
    worst = (out.double() - truth).abs().flatten().argmax().item()
    assert torch.isfinite(out).all(), "kernel output has NaN/Inf"
    assert err <= 2 * torch_err + 1e-5, (
        f"kernel error {err:.3e} > 2 x PyTorch {qdtype} error {torch_err:.3e}; worst element {worst}: "
        f"kernel {out.flatten()[worst].item():.6f} vs fp64 {truth.flatten()[worst].item():.6f}")
    return truth, torch_err


def _qdtype(fmt, shape):
    if fmt.dtype == "fp32":
        return torch.float32  # fp32 dots: the tightest bound
    return torch.float16 if shape == "gqa2-page16" else torch.bfloat16


def _planned(args, sm_scale, p_scale=None, **tiles):
    """prefill_context_attention under its default plan with `tiles` (block_m, block_n) and, where the format and q
    dtype allow V's scales on p, `p_scale`."""
    q, cache = args[0], args[4]
    plan = prefill_plan(cache.fmt, q.device, q_dtype=q.dtype)
    if p_scale is not None:
        tiles["p_scale"] = p_scale and plan.p_scale  # the default says where it serves
    return prefill_context_attention(*args, sm_scale, plan=replace(plan, **tiles))


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_prefill_context_relative_oracle(fmt, shape):
    gen = torch.Generator().manual_seed(zlib.crc32(f"prefill{shape}{fmt.name}".encode()))
    qdtype = _qdtype(fmt, shape)
    args = _build(fmt, SHAPES[shape], gen, qdtype)
    sm_scale = 1.0 / math.sqrt(args[0].shape[-1])
    out = _planned(args, sm_scale, **SHAPES[shape]["tiles"])
    assert out.dtype == qdtype and out.shape == args[0].shape
    truth, torch_err = _check(out, args, sm_scale, qdtype)
    # and the reference op it replaces, within the same bound
    ref = ref_ops.prefill_context_attention(*args, sm_scale)
    assert _relerr(out, ref.double()) <= 2 * torch_err + 1e-5
    if CUDA:  # the reference computes in q's dtype there (SDPA): the kernel is no worse
        assert _relerr(out, truth) <= 2 * _relerr(ref, truth) + 1e-5


# Mixed formats (K and V stored differently, group scales): their context pages are read back unquantized
# (launch_mixed.context_pages) and the same kernel runs over them.
MIXED_FORMATS = [
    KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False),
    KVFormat("fp8_e4m3", "per_token", v_dtype="int4", v_symmetric=False),
    KVFormat("int4", "per_token", symmetric=False, group_size=16),
]


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("fmt", MIXED_FORMATS, ids=[f.name for f in MIXED_FORMATS])
def test_mixed_formats_prefill_context_relative_oracle(fmt, shape):
    gen = torch.Generator().manual_seed(zlib.crc32(f"mixed{shape}{fmt.name}".encode()))
    qdtype = _qdtype(fmt, shape)
    args = _build(fmt, SHAPES[shape], gen, qdtype, v_per_token=True)
    sm_scale = 1.0 / math.sqrt(args[0].shape[-1])
    out = prefill_context_attention(*args, sm_scale)
    assert out.dtype == qdtype and out.shape == args[0].shape
    _check(out, args, sm_scale, qdtype)
    q, k, v, cu, cache, bt, _ = args  # and with no context at all: the chunks' own keys alone
    none = torch.zeros(cu.numel() - 1, dtype=torch.int32, device=DEV)
    _check(prefill_context_attention(q, k, v, cu, cache, bt, none, sm_scale), [q, k, v, cu, cache, bt, none],
           sm_scale, qdtype)


# Per-token formats, V's scales on p (PrefillPlan.p_scale, the default for symmetric formats with bf16 q; the
# others take the fp32 path) and on V in fp32 (p_scale=False), with V whose scales and zero points vary strongly from token to token
# (_build's v_per_token): a scale or zero point applied to another token's values, or dropped, is
# far outside the oracle's bound.
TOKEN_FORMATS = [
    KVFormat("int8", "per_token"),
    KVFormat("int8", "per_token", symmetric=False),
    KVFormat("int4", "per_token"),
    KVFormat("int4", "per_token", symmetric=False),
    KVFormat("fp8_e4m3", "per_token"),
    KVFormat("fp8_e5m2", "per_token", scale_dtype="bfloat16"),
]
V_PATHS = [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False), (torch.float16, True)]


@pytest.mark.parametrize("qdtype,p_scale", V_PATHS, ids=["bf16-p", "bf16-v", "fp32-v", "fp16"])
@pytest.mark.parametrize("fmt", TOKEN_FORMATS, ids=[f.name for f in TOKEN_FORMATS])
def test_per_token_v_scales_that_vary_by_token(fmt, qdtype, p_scale):
    gen = torch.Generator().manual_seed(zlib.crc32(f"vtok{fmt.name}".encode()))
    args = _build(fmt, SHAPES["gqa2-page16"], gen, qdtype, v_per_token=True)
    out = _planned(args, 0.2, p_scale, **SHAPES["gqa2-page16"]["tiles"])
    _check(out, args, 0.2, qdtype)


def test_default_tiles_and_public_op():
    """The public op under its default plan (one tile spans a whole CPU-sized chunk) agrees too."""
    fmt = KVFormat("int8", "per_token")
    gen = torch.Generator().manual_seed(5)
    args = _build(fmt, SHAPES["gqa3-page5"], gen, torch.bfloat16)
    out = prefill_context_attention(*args, 0.25)
    _check(out, args, 0.25, torch.bfloat16)


def test_without_context_equals_prefill_attention():
    """Contexts all 0: causal attention over each chunk alone, as prefill_attention."""
    gen = torch.Generator().manual_seed(6)
    args = _build(KVFormat("fp32"), SHAPES["gqa3-page5"], gen, torch.float32)
    args[-1] = torch.zeros_like(args[-1])
    out = _planned(args, 0.3, block_m=16, block_n=16)
    ref = ref_ops.prefill_attention(*args[:4], 0.3)
    assert (out - ref).abs().max().item() <= 1e-5


def test_many_chunks_find_their_tiles():
    """20 chunks (empty ones among them, 4-token tiles): every program finds its chunk and tile
    from cu_seqlens alone."""
    gen = torch.Generator().manual_seed(9)
    chunks = list(zip(torch.randint(0, 13, (20,), generator=gen).tolist(),
                      torch.randint(0, 10, (20,), generator=gen).tolist()))
    chunks[0], chunks[7], chunks[19] = (5, 0), (0, 0), (3, 0)
    s = dict(heads=8, kv_heads=2, head_dim=16, block_size=4, chunks=chunks)
    args = _build(KVFormat("fp32"), s, gen, torch.float32)
    out = _planned(args, 0.3, block_m=16, block_n=16)
    assert (out - ref_ops.prefill_context_attention(*args, 0.3)).abs().max().item() <= 1e-5


def test_triton_backend_selects_the_kernel():
    backend = ref_ops.select_backend("cuda")
    assert backend.prefill_context_attention is prefill_context_attention
    assert "prefill_context_attention" in backend.name


def test_rejects_bad_input():
    gen = torch.Generator().manual_seed(7)
    q, k, v, cu, cache, bt, ctx = _build(KVFormat("int8", "per_token"), SHAPES["gqa2-page16"], gen, torch.float16)
    with pytest.raises(ValueError, match="not a multiple"):
        prefill_context_attention(q[:, :3], k, v, cu, cache, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="k and v must both be"):
        prefill_context_attention(q, k[:-1], v, cu, cache, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        prefill_context_attention(q, k, v, cu.long(), cache, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        prefill_context_attention(q, k, v, cu, cache, bt, ctx[:-1], 1.0)
    with pytest.raises(ValueError, match="a row per chunk"):
        prefill_context_attention(q, k, v, cu, cache, bt[:-1], ctx, 1.0)
    plan = prefill_plan(cache.fmt, q.device, q_dtype=q.dtype)
    with pytest.raises(ValueError, match=r"PrefillPlan.block_n=24: use a power of two"):
        prefill_context_attention(q, k, v, cu, cache, bt, ctx, 1.0, plan=replace(plan, block_n=24))
    with pytest.raises(ValueError, match=r"PrefillPlan.p_scale=True"):  # fp16 q: p s could leave fp16's range
        prefill_context_attention(q, k, v, cu, cache, bt, ctx, 1.0, plan=replace(plan, p_scale=True))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_launch_replays_from_a_cuda_graph():
    """The launcher reads nothing back from the device, so a step can capture it."""
    gen = torch.Generator().manual_seed(8)
    args = _build(KVFormat("int4", "per_token", symmetric=False), SHAPES["llama8b"], gen, torch.bfloat16)
    eager = prefill_context_attention(*args, 0.088)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = prefill_context_attention(*args, 0.088)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
