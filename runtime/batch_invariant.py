"""Batch-invariant numerics: a row's result does not depend on the rows computed beside it.

A request's K/V must come out bit-identical whether it runs alone, among 63 others, in
chunks of any size or recomputed after preemption: the quantizer turns last-bit
differences into different codes, and greedy decoding amplifies those into different
text (docs/numerics.md; "Defeating Nondeterminism in LLM Inference", Thinking Machines
2025; vLLM's batch-invariant mode; SGLang's deterministic inference). Elementwise ops and
RMSNorm are row-local already; what varies with the batch is the reduction order of:

* matmuls: BLAS libraries pick kernels by shape. On the CPU a GEMM's rows agree bit for bit
  for every row count that is a multiple of a small tile, but a single row runs a GEMV with
  another summation order. `linear` pads the rows to that tile; `row_tile()` measures it on
  the running machine (a multiple of the tile must give every row the bits it gets alone).
* attention: decode, a whole prompt and a chunk attend through different ops and shapes.
  `attend` is the one computation all three run: keys in fixed blocks of KEY_BLOCK (every
  block's matmul has the same shape whatever the context length), the blocks' partial sums
  added in order by a scan (trailing all-masked blocks add exact zeros), the softmax
  denominator computed by the same matmul as the numerator (a ones column beside V).

`linear` also picks the faster CPU GEMM where it exists: oneDNN's, ~1.2-1.8x MKL's on the
2-core AMD EPYC (Zen 4) machines kvq develops on, at the shapes of small-batch decode.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from .attention import gather_kv, write_kv
from .config import ceil_div
from .errors import UnsupportedError
from .kv_cache import LayerCache

KEY_BLOCK = 64
ATTEND_ROWS = 512  # query rows per attention call: bounds the score tensor of a long prompt
_TILES = (2, 4, 8, 16, 32)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


@functools.cache
def _cpu_gemm():
    """oneDNN's fp32 linear where this torch build has it and it agrees with F.linear, else F.linear."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return F.linear
    x, w = torch.randn(5, 64), torch.randn(48, 64)
    try:
        ok = torch.allclose(_onednn_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    except RuntimeError:
        ok = False
    return _onednn_linear if ok else F.linear


def fast_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T: oneDNN on the CPU (fp32), F.linear elsewhere."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return _cpu_gemm()(x, w)
    return F.linear(x, w)


def _pad_rows(x: torch.Tensor, tile: int, dim: int = 0) -> torch.Tensor:
    n = x.shape[dim]
    extra = ceil_div(n, tile) * tile - n
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat((x, x.new_zeros(shape)), dim)


def _batched(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x[None], w.t()[None])[0]


@functools.cache
def row_tile(op: str, device_type: str, dtype: torch.dtype, n: int, k: int) -> int:
    """The smallest row tile whose multiples give every row of an [M, k] x [k, n] product the bits
    it gets alone (padded to the tile), measured on this machine with `op` ("linear": fast_linear,
    "matmul": the batched torch.matmul attention uses)."""
    fn = fast_linear if op == "linear" else _batched
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(device_type, dtype)
    x = torch.randn(67, k, generator=gen).to(device_type, dtype)
    for tile in _TILES:
        alone = torch.cat([fn(_pad_rows(x[i:i + 1], tile), w)[:1] for i in range(x.shape[0])])
        if all(torch.equal(fn(_pad_rows(x[:m], tile), w)[:m], alone[:m]) for m in (tile + 1, 29, 67)):
            return tile
    raise UnsupportedError(
        f"batch-invariant mode: no row tile up to {_TILES[-1]} makes this {device_type} GEMM ({op}, {n}x{k}) give "
        "a row the same bits in every batch; build the engine with build.batch_invariant: false.")


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Batch-invariant x [M, K] @ w [N, K]^T: rows padded to the machine's row tile."""
    m = x.shape[0]
    tile = row_tile("linear", x.device.type, x.dtype, w.shape[0], w.shape[1])
    return fast_linear(_pad_rows(x, tile), w)[:m]


# -------------------------------------------------------------- attention
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [N, R, D] rows, k/v [N, L, D], lens [N, R] (row r sees keys 0 .. lens-1) -> [N, R, D] fp32.

    A row's result depends only on its query and its first lens keys: not on R, L, N or the
    other rows (zeros pad L to whole key blocks and R to the row tile; masked keys get p = 0).
    """
    n, r, d = q.shape
    dev = q.device.type
    tile = max(row_tile("matmul", dev, torch.float32, KEY_BLOCK, d), row_tile("matmul", dev, torch.float32, d + 1, KEY_BLOCK))
    q, lens = _pad_rows(q.float(), tile, 1), _pad_rows(lens, tile, 1).clamp_min(1)
    k, v = _pad_rows(k.float(), KEY_BLOCK, 1), _pad_rows(v.float(), KEY_BLOCK, 1)
    nb = k.shape[1] // KEY_BLOCK
    kb = k.view(n, nb, KEY_BLOCK, d)
    # [N, nb, R, KEY_BLOCK]: one matmul shape per key block, whatever L is
    s = torch.matmul(q[:, None], kb.transpose(-1, -2)) * sm_scale
    key = torch.arange(nb * KEY_BLOCK, device=q.device).view(nb, 1, KEY_BLOCK)
    s.masked_fill_(key[None] >= lens[:, None, :, None], float("-inf"))
    p = torch.exp(s - s.amax(dim=(1, 3), keepdim=True))
    ones = torch.ones(n, nb * KEY_BLOCK, 1, dtype=v.dtype, device=v.device)
    vb = torch.cat((v, ones), -1).view(n, nb, KEY_BLOCK, d + 1)
    # partial sums per key block, added left to right: a scan's last element
    acc = torch.matmul(p, vb).cumsum(1)[:, -1]
    return (acc[..., :d] / acc[..., d:])[:, :r]


def _attend_rows(q, k, v, lens, sm_scale):
    """attend over row chunks of ATTEND_ROWS (bounded memory; rows are independent anyway)."""
    if q.shape[1] <= ATTEND_ROWS:
        return attend(q, k, v, lens, sm_scale)
    return torch.cat([attend(q[:, i:i + ATTEND_ROWS], k, v, lens[:, i:i + ATTEND_ROWS], sm_scale)
                      for i in range(0, q.shape[1], ATTEND_ROWS)], 1)


def decode_attention(q, cache: LayerCache, block_tables, seq_lens, sm_scale):
    """The decode op (runtime/attention.py's signature) through `attend`."""
    b, nh, d = q.shape
    h = cache.kv_heads
    g = nh // h
    max_len = int(seq_lens.max().item())
    k, v = gather_kv(cache, block_tables, max_len)  # [B, H, L, D]
    lens = seq_lens.to(q.device).long().view(b, 1, 1).expand(b, h, g).reshape(b * h, g)
    out = attend(q.view(b * h, g, d), k.reshape(b * h, max_len, d), v.reshape(b * h, max_len, d), lens, sm_scale)
    return out.reshape(b, nh, d).to(q.dtype)


def _prefill(q, k, v, cu_seqlens, sm_scale, context=None):
    out = torch.empty_like(q)
    nh, d = q.shape[1], q.shape[2]
    h = k.shape[1]
    g = nh // h
    bounds = cu_seqlens.tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b == a:
            continue
        ks, vs = k[a:b].transpose(0, 1).float(), v[a:b].transpose(0, 1).float()  # [H, T, D]
        ctx = context[2][i] if context is not None else 0
        if ctx:
            cache, tables, _ = context
            kc, vc = gather_kv(cache, tables[i:i + 1], ctx)
            ks, vs = torch.cat((kc[0], ks), 1), torch.cat((vc[0], vs), 1)
        t = b - a
        # rows (token, query head of the group) of KV head j: [H, T * G, D]
        qs = q[a:b].view(t, h, g, d).permute(1, 0, 2, 3).reshape(h, t * g, d)
        lens = (torch.arange(t, device=q.device) + ctx + 1).repeat_interleave(g).expand(h, t * g)
        o = _attend_rows(qs, ks, vs, lens, sm_scale)  # [H, T * G, D]
        out[a:b] = o.reshape(h, t, g, d).permute(1, 0, 2, 3).reshape(t, nh, d).to(q.dtype)
    return out


def prefill_attention(q, k, v, cu_seqlens, sm_scale):
    return _prefill(q, k, v, cu_seqlens, sm_scale)


def prefill_context_attention(q, k, v, cu_seqlens, cache, block_tables, context_lens, sm_scale):
    return _prefill(q, k, v, cu_seqlens, sm_scale, (cache, block_tables, context_lens.tolist()))


def check(weights: list[torch.Tensor], head_dim: int) -> None:
    """Measure every row tile the model's matmuls and attention need, so that a machine whose
    GEMMs cannot be made batch-invariant refuses the mode when the engine is built."""
    w = weights[0]
    for t in weights:
        row_tile("linear", t.device.type, t.dtype, t.shape[0], t.shape[1])
    row_tile("matmul", w.device.type, torch.float32, KEY_BLOCK, head_dim)
    row_tile("matmul", w.device.type, torch.float32, head_dim + 1, KEY_BLOCK)


def backend() -> types.SimpleNamespace:
    """The attention ops of the batch-invariant mode (every device; torch ops)."""
    return types.SimpleNamespace(
        name="batch-invariant", write_kv=write_kv, decode_attention=decode_attention,
        prefill_attention=prefill_attention, prefill_context_attention=prefill_context_attention, linear=linear,
    )
