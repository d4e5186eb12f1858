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
  Decode runs `attend`'s maths (`_attend_padded`) on operands laid out once per step: every
  layer of a step reads the same pages, so the page list, the key mask and the padded query
  and V buffers are built by the first layer and reused (`_DecodePlan`), and K/V pages are
  gathered with one index_select each, straight into attend's (KV head, sequence) row order.

`linear` also picks the faster CPU GEMM where it exists: oneDNN's, ~1.2-1.8x MKL's on the
2-core AMD EPYC (Zen 4) machines kvq develops on, at the shapes of small-batch decode, and
faster again with the weights laid out once in oneDNN's own format (`pack_weight`), with which
a single row can take a batch's summation order (row tile 1: batch 1 pads nothing).
"""

from __future__ import annotations

import functools
import threading
import types

import torch
import torch.nn.functional as F

from . import channel_keys
from .attention import _static_scale, gather_kv, write_kv
from .config import ceil_div
from .errors import UnsupportedError
from .kv_cache import LayerCache
from .kv_quant import dequantize

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


# The batch size oneDNN lays a packed weight out for. Any other row count uses the same packed
# weight at full speed (timed at 1-2048 rows); 8 and 64 both make one row give the bits it
# gets in a batch where the reduction is 576 long.
PACK_ROWS = 64


@functools.cache
def _packs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `pack_weight` lays weights of this device and dtype out for oneDNN: fp32 on the CPU where
    oneDNN is the GEMM and a packed weight gives the unpacked weight's values."""
    if device_type != "cpu" or dtype != torch.float32 or _cpu_gemm() is not _onednn_linear:
        return False
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=gen), torch.randn(48, 64, generator=gen)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        return torch.allclose(_onednn_linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] in the form `fast_linear` multiplies fastest, same values. CPU fp32: laid out once
    in oneDNN's blocked format (an opaque mkldnn tensor; `.shape`, `.dtype` and `.numel()` work, indexing
    does not). Against the plain weight, a decode step's linears take ~0.6x the time at 8 rows and
    ~0.7x at 1 row (SmolLM2, 1 thread), and at 2 rows and more the products are bit for bit those of
    the plain weight. Elsewhere `w` itself."""
    if w.dim() == 2 and not w.is_mkldnn and _packs(w.device.type, w.dtype):
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS)
    return w


def fast_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T: oneDNN on the CPU (fp32; w plain or from `pack_weight`), F.linear elsewhere."""
    if w.is_mkldnn:
        return _onednn_linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
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
def row_tile(op: str, device_type: str, dtype: torch.dtype, n: int, k: int, packed: bool = False) -> int:
    """The smallest row tile whose multiples give every row of an [M, k] x [k, n] product the bits
    it gets alone (padded to the tile), measured on this machine with `op` ("linear": fast_linear,
    of a weight from `pack_weight` if `packed`; "matmul": the batched torch.matmul attention uses)."""
    fn = fast_linear if op == "linear" else _batched
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(device_type, dtype)
    if packed:
        w = pack_weight(w)
    x = torch.randn(67, k, generator=gen).to(device_type, dtype)
    # one row alone runs a GEMV on a plain weight, never a batch's summation order; a packed
    # weight's single row can share it, and then needs no padding
    for tile in ((1,) if packed else ()) + _TILES:
        alone = torch.cat([fn(_pad_rows(x[i:i + 1], tile), w)[:1] for i in range(x.shape[0])])
        if all(torch.equal(fn(_pad_rows(x[:m], tile), w)[:m], alone[:m]) for m in (tile + 1, 29, 67)):
            return tile
    raise UnsupportedError(
        f"batch-invariant mode: no row tile up to {_TILES[-1]} makes this {device_type} GEMM ({op}, {n}x{k}) give "
        "a row the same bits in every batch; build the engine with build.batch_invariant: false.")


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Batch-invariant x [M, K] @ w [N, K]^T: rows padded to the machine's row tile (none where it is 1)."""
    m = x.shape[0]
    tile = row_tile("linear", x.device.type, x.dtype, w.shape[0], w.shape[1], w.is_mkldnn)
    if tile == 1:
        return fast_linear(x, w)
    return fast_linear(_pad_rows(x, tile), w)[:m]


# -------------------------------------------------------------- attention
def _attend_tile(device_type: str, d: int) -> int:
    return max(row_tile("matmul", device_type, torch.float32, KEY_BLOCK, d),
               row_tile("matmul", device_type, torch.float32, d + 1, KEY_BLOCK))


def _key_mask(lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """lens [N, R] -> [N, nb, R, KEY_BLOCK] bool, True where a row must not see the key."""
    key = torch.arange(num_keys, device=lens.device).view(num_keys // KEY_BLOCK, 1, KEY_BLOCK)
    return key[None] >= lens[:, None, :, None]


def _attend_padded(q: torch.Tensor, k: torch.Tensor, v1: torch.Tensor, masked: torch.Tensor,
                   sm_scale: float) -> torch.Tensor:
    """The maths of `attend` on padded operands: q [N, R, D] (R a multiple of the row tile), k [N, L, D]
    and v1 [N, L, D + 1] (V beside a ones column; L a multiple of KEY_BLOCK), `masked` broadcastable
    to [N, L / KEY_BLOCK, R, KEY_BLOCK] -> [N, R, D]."""
    n, _, d = q.shape
    nb = k.shape[1] // KEY_BLOCK
    # [N, nb, R, KEY_BLOCK]: one matmul shape per key block, whatever L is
    s = torch.matmul(q[:, None], k.view(n, nb, KEY_BLOCK, d).transpose(-1, -2)).mul_(sm_scale)
    s.masked_fill_(masked, float("-inf"))
    p = s.sub_(s.amax(dim=(1, 3), keepdim=True)).exp_()  # in place: the same values, two temporaries fewer
    # partial sums per key block, added left to right: a scan's last element
    acc = torch.matmul(p, v1.view(n, nb, KEY_BLOCK, d + 1)).cumsum(1)[:, -1]
    return acc[..., :d] / acc[..., d:]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [N, R, D] rows, k/v [N, L, D], lens [N, R] (row r sees keys 0 .. lens-1) -> [N, R, D] fp32.

    A row's result depends only on its query and its first lens keys: not on R, L, N or the
    other rows (zeros pad L to whole key blocks and R to the row tile; masked keys get p = 0).
    """
    n, r, d = q.shape
    tile = _attend_tile(q.device.type, d)
    q, lens = _pad_rows(q.float(), tile, 1), _pad_rows(lens, tile, 1).clamp_min(1)
    k, v = _pad_rows(k.float(), KEY_BLOCK, 1), _pad_rows(v.float(), KEY_BLOCK, 1)
    v1 = torch.cat((v, torch.ones(n, v.shape[1], 1, dtype=v.dtype, device=v.device)), -1)
    return _attend_padded(q, k, v1, _key_mask(lens, k.shape[1]), sm_scale)[:, :r]


def _attend_rows(q, k, v, lens, sm_scale):
    """attend over row chunks of ATTEND_ROWS (bounded memory; rows are independent anyway)."""
    if q.shape[1] <= ATTEND_ROWS:
        return attend(q, k, v, lens, sm_scale)
    return torch.cat([attend(q[:, i:i + ATTEND_ROWS], k, v, lens[:, i:i + ATTEND_ROWS], sm_scale)
                      for i in range(0, q.shape[1], ATTEND_ROWS)], 1)


class _DecodePlan:
    """What every layer's decode attention of one step shares (the block tables, hence the pages each
    sequence reads, are the same in every layer): computed by the first layer, reused by the rest.
    Rows are ordered (KV head, sequence), so that one gather per layer lands pages in attend's order."""

    def __init__(self, cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor, group: int,
                 head_dim: int):
        self.key = self._key(cache, group, head_dim)
        self.tables, self.lens = block_tables.clone(), seq_lens.clone()
        b, h, dev = block_tables.shape[0], cache.kv_heads, block_tables.device
        # whole key blocks, so that attend has no K/V to pad: pages past a table's end read page 0
        # (finite, and masked)
        self.num_keys = ceil_div(int(seq_lens.max().item()), KEY_BLOCK) * KEY_BLOCK
        pages = self.num_keys // cache.block_size
        self.pages = _pad_rows(block_tables, pages, 1)[:, :pages].reshape(-1).long()
        tile = _attend_tile(dev.type, head_dim)
        self.rows = ceil_div(group, tile) * tile
        lens = seq_lens.to(dev).long().view(1, b, 1).expand(h, b, 1).reshape(h * b, 1)
        self.masked = _key_mask(lens, self.num_keys)  # [H * B, nb, 1, KEY_BLOCK]: the same for every row
        self.q = torch.zeros(h, b, self.rows, head_dim, device=dev)  # rows past the group stay zero
        self.k = torch.empty(h, b * pages, cache.block_size, head_dim, device=dev)
        self.v1 = torch.ones(h, b * pages, cache.block_size, head_dim + 1, device=dev)  # V beside ones

    @staticmethod
    def _key(cache: LayerCache, group: int, head_dim: int) -> tuple:
        return cache.block_size, cache.kv_heads, group, head_dim

    def matches(self, cache: LayerCache, block_tables, seq_lens, group: int, head_dim: int) -> bool:
        """Whether this plan serves the call: by the values of its block tables and lengths (a step's every layer
        passes the same ones), not by tensor identity, which an in-place update or a freed-and-reused tensor would
        fool (and inference tensors keep no version counter)."""
        return (self.key == self._key(cache, group, head_dim)
                and self.tables.shape == block_tables.shape and self.lens.shape == seq_lens.shape
                and torch.equal(self.tables, block_tables) and torch.equal(self.lens, seq_lens))


_plans = threading.local()  # an engine's steps run on its own thread


def _gather(cache: LayerCache, which: str, pages: torch.Tensor) -> torch.Tensor:
    """K or V pages of the plan, dequantized fp32: [B * pages, kv_heads, block_size, D] (pages along the
    first axis: an index_select of whole contiguous pages, much faster than one along a strided axis)."""
    fmt = cache.fmt.side(which)
    q = getattr(cache, which).index_select(0, pages)
    scale, zero = getattr(cache, f"{which}_scale"), getattr(cache, f"{which}_zero")
    if fmt.dynamic:
        scale = scale.index_select(0, pages)
        zero = zero.index_select(0, pages) if zero is not None else None
    elif fmt.static:
        scale = _static_scale(scale)
    return dequantize(q, fmt, scale, zero, torch.float32)


def attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                  visible: torch.Tensor) -> torch.Tensor:
    """`attend`'s maths under any key mask, with attention._sdpa's operands: q [heads, T, D], k/v [kv_heads, L, D],
    visible [T, L] bool -> [heads, T, D] fp32. A row's result depends on its query and the keys it sees (and
    their order), not on T, L or the keys it does not see: masked key blocks add exact zeros to the scan."""
    nh, t, d = q.shape
    h = k.shape[0]
    g = nh // h
    tile = _attend_tile(q.device.type, d)
    k, v = _pad_rows(k.float(), KEY_BLOCK, 1), _pad_rows(v.float(), KEY_BLOCK, 1)
    v1 = torch.cat((v, torch.ones(h, v.shape[1], 1, dtype=v.dtype, device=v.device)), -1)
    visible = _pad_rows(visible, KEY_BLOCK, 1)
    outs = []
    step = max(1, ATTEND_ROWS // g)
    for a in range(0, t, step):
        n = min(step, t - a) * g
        rows = q[:, a:a + step].float().view(h, g, -1, d).transpose(1, 2).reshape(h, n, d)  # (token, group) rows
        vis = _pad_rows(visible[a:a + step].repeat_interleave(g, 0), tile, 0)
        vis[n:, 0] = True  # padding rows see one key: finite, and dropped
        masked = ~vis.view(vis.shape[0], -1, KEY_BLOCK).transpose(0, 1)[None]  # [1, nb, R, KEY_BLOCK]
        o = _attend_padded(_pad_rows(rows, tile, 1), k, v1, masked, sm_scale)[:, :n]
        outs.append(o.view(h, -1, g, d).permute(0, 2, 1, 3).reshape(nh, -1, d))
    return torch.cat(outs, 1)


def decode_attention(q, cache: LayerCache, block_tables, seq_lens, sm_scale):
    """The decode op (runtime/attention.py's signature) through `attend`'s maths."""
    if cache.fmt.per_channel_keys:
        return channel_keys.decode_attention(q, cache, block_tables, seq_lens, sm_scale, attend_masked)
    b, nh, d = q.shape
    h = cache.kv_heads
    g = nh // h
    plan = getattr(_plans, "decode", None)
    if plan is None or not plan.matches(cache, block_tables, seq_lens, g, d):
        plan = _plans.decode = _DecodePlan(cache, block_tables, seq_lens, g, d)
    plan.q[:, :, :g] = q.reshape(b, h, g, d).transpose(0, 1)
    plan.k.copy_(_gather(cache, "k", plan.pages).transpose(0, 1))
    plan.v1[..., :d] = _gather(cache, "v", plan.pages).transpose(0, 1)
    k = plan.k.view(h * b, plan.num_keys, d)
    v1 = plan.v1.view(h * b, plan.num_keys, d + 1)
    out = _attend_padded(plan.q.view(h * b, plan.rows, d), k, v1, plan.masked, sm_scale)
    return out.view(h, b, plan.rows, d)[:, :, :g].transpose(0, 1).reshape(b, nh, d).to(q.dtype)


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
    if cache.fmt.per_channel_keys:
        return channel_keys.prefill(q, k, v, cu_seqlens, cache, block_tables, context_lens.tolist(), sm_scale,
                                    attend_masked)
    return _prefill(q, k, v, cu_seqlens, sm_scale, (cache, block_tables, context_lens.tolist()))


def check(weights: list[torch.Tensor], head_dim: int) -> None:
    """Measure every row tile the model's matmuls and attention need, so that a machine whose
    GEMMs cannot be made batch-invariant refuses the mode when the engine is built."""
    w = weights[0]
    for t in weights:
        row_tile("linear", t.device.type, t.dtype, t.shape[0], t.shape[1], t.is_mkldnn)
    _attend_tile(w.device.type, head_dim)


def backend() -> types.SimpleNamespace:
    """The attention ops of the batch-invariant mode (every device; torch ops)."""
    return types.SimpleNamespace(
        name="batch-invariant", write_kv=write_kv, decode_attention=decode_attention,
        prefill_attention=prefill_attention, prefill_context_attention=prefill_context_attention, linear=linear,
    )
