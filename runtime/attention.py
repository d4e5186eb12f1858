"""Attention over the paged, quantized KV cache: the reference path.

These four ops are the contract the Triton kernels in runtime/kernels/
implement with the same signatures (docs/interfaces.md), and the oracle they
are tested against. The reference path runs everywhere (CPU included):

* write_kv: quantize with runtime.kv_format (the one definition of every
  rounding decision) and scatter into the pages named by the slot mapping.
* decode_attention: gather each sequence's pages, dequantize, attend in fp32.
  Sequences of one step are padded to the longest and masked, so a whole
  decode batch is a handful of batched ops instead of a loop per sequence.
* prefill_attention: causal attention of prompt tokens to themselves.
* prefill_context_attention: the same for a chunk of a prompt whose earlier
  chunks are already in the cache (chunked prefill): the context is read back
  and dequantized like decode's.
* read_kv: a step's own K/V read back from the cache, as stored. The model
  writes a step's K/V first and hands the prefill ops these values instead of
  the ones it just computed ("write, then read"; docs/numerics.md), so every
  attention sees a token's K/V as the cache holds them, whatever the chunking.

Per-channel keys (k.int4-per_channel-asym) have their own write and attention, runtime/channel_keys.py; the
ops here hand them over, so the signatures stay the same.
"""

from __future__ import annotations

import importlib
import itertools
import types
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from . import channel_keys
from .config import ceil_div
from .kv_cache import LayerCache
from .kv_format import KVFormat
from .kv_quant import dequantize, quantize, quantize_dynamic


# ------------------------------------------------------------------ write
def _write_one(cache: LayerCache, which: str, x: torch.Tensor, blocks: torch.Tensor, offs: torch.Tensor) -> None:
    fmt = cache.fmt.side(which)
    pages: torch.Tensor = getattr(cache, which)
    if fmt.dynamic:
        q, scale, zero = quantize_dynamic(x, fmt)
        if scale.dtype == torch.float8_e8m0fnu:  # torch has no index_put for e8m0: write its bytes
            getattr(cache, f"{which}_scale").view(torch.uint8)[blocks, :, offs] = scale.view(torch.uint8)
        else:
            getattr(cache, f"{which}_scale")[blocks, :, offs] = scale
        if zero is not None:
            getattr(cache, f"{which}_zero")[blocks, :, offs] = zero
    else:
        q = quantize(x, fmt, getattr(cache, f"{which}_scale"))
    # Advanced indices split by a slice put the indexed dim first: [T, kv_heads, D].
    pages[blocks, :, offs] = q


def write_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] (k after RoPE) -> pages at slot = block * block_size + offset."""
    slots = slot_mapping.long()
    blocks, offs = slots // cache.block_size, slots % cache.block_size
    if cache.fmt.per_channel_keys:
        channel_keys.write_keys(cache, k, slots)
    else:
        _write_one(cache, "k", k, blocks, offs)
    _write_one(cache, "v", v, blocks, offs)


# ------------------------------------------------------------------ read
def stores_exactly(fmt: KVFormat, dtype: torch.dtype) -> bool:
    """True when the cache holds values of `dtype` unchanged (unquantized, same dtype): read_kv is the identity."""
    return not fmt.quantized and fmt.storage_dtype == dtype  # a split format is quantized


def read_kv(cache: LayerCache, slot_mapping: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the tokens at `slot_mapping` as stored (dequantized), [T, kv_heads, head_dim] in `dtype`.

    The same dequantize as gather_kv's, element by element, so a token's values here equal
    those decode reads back from its pages, bit for bit.
    """
    slots = slot_mapping.long()
    blocks, offs = slots // cache.block_size, slots % cache.block_size
    out = []
    for which in ("k", "v"):
        fmt = cache.fmt.side(which)
        if fmt.per_channel_keys:
            out.append(channel_keys.read_keys(cache, blocks, offs).to(dtype))
            continue
        q = getattr(cache, which)[blocks, :, offs]  # [T, kv_heads, stored_head_dim]
        scale = getattr(cache, f"{which}_scale")
        zero = getattr(cache, f"{which}_zero")
        if fmt.dynamic:
            scale = scale[blocks, :, offs]
            zero = zero[blocks, :, offs] if zero is not None else None
        # static scales, [] or [kv_heads], broadcast over [T, kv_heads] as they are
        out.append(dequantize(q, fmt, scale, zero, torch.float32).to(dtype))
    return out[0], out[1]


# ----------------------------------------------------------------- gather
def _static_scale(scale: torch.Tensor) -> torch.Tensor:
    # per_head scales [kv_heads] must broadcast over [B, kv_heads, L, D]; dequantize adds the last axis.
    return scale.view(-1, 1) if scale.dim() == 1 else scale


def gather_kv(cache: LayerCache, block_tables: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized fp32 K and V of each sequence: [B, kv_heads, max_len, head_dim]."""
    if cache.fmt.per_channel_keys:
        from .errors import UnsupportedError

        raise UnsupportedError(f"{cache.fmt.name}: a query reads its own block's keys in fp16, the others "
                               "quantized; there is no one K per position to gather (runtime/channel_keys.py).")
    nb = ceil_div(max_len, cache.block_size)
    bt = block_tables[:, :nb].long()
    b = bt.shape[0]

    def pages(t: torch.Tensor) -> torch.Tensor:
        # [B, nb, H, BS, ...] -> [B, H, nb * BS, ...], then cut to the longest sequence.
        g = t[bt].transpose(1, 2)
        return g.reshape(b, g.shape[1], nb * cache.block_size, *g.shape[4:])[:, :, :max_len]

    out = []
    for which in ("k", "v"):
        fmt = cache.fmt.side(which)
        q = pages(getattr(cache, which))
        scale = getattr(cache, f"{which}_scale")
        zero = getattr(cache, f"{which}_zero")
        if fmt.dynamic:
            scale = pages(scale)
            zero = pages(zero) if zero is not None else None
        elif fmt.static:
            scale = _static_scale(scale)
        out.append(dequantize(q, fmt, scale, zero, torch.float32))
    return out[0], out[1]


# ---------------------------------------------------------------- decode
def decode_attention(
    q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
    p_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """q [B, num_heads, head_dim]; seq_lens include the token just written. Out in q.dtype.

    p_dtype: round the probabilities to it before p . V, as a tensor-core kernel does (to tell
    a kernel's rounding from a kernel bug; benchmarks/e2e_smollm2.py).
    """
    if cache.fmt.per_channel_keys:
        return channel_keys.decode_attention(q, cache, block_tables, seq_lens, sm_scale, _sdpa)
    b, nh, d = q.shape
    h = cache.kv_heads
    max_len = int(seq_lens.max().item())
    k, v = gather_kv(cache, block_tables, max_len)
    # GQA without repeating K/V: query heads of one KV head form the "row" axis.
    qf = q.to(torch.float32).view(b, h, nh // h, d)
    scores = torch.matmul(qf, k.transpose(-1, -2)) * sm_scale  # [B, H, G, L]
    pad = torch.arange(max_len, device=q.device)[None, :] >= seq_lens.to(q.device).long()[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if p_dtype is not None:
        p = p.to(p_dtype).to(torch.float32)
    out = torch.matmul(p, v)  # [B, H, G, D]
    return out.reshape(b, nh, d).to(q.dtype)


# --------------------------------------------------------------- prefill
def _sdpa(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, sm_scale: float,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    """[heads, Tq, D] x [kv_heads, Tk, D] -> [heads, Tq, D]: causal (mask None) or under a boolean mask."""
    causal = mask is None
    # 4-D [batch, heads, T, D] inputs: with 3-D ones SDPA takes its slow math kernel
    # (a [heads, T, T] matrix per layer), on CUDA and on the CPU alike.
    gqa = {"enable_gqa": True}
    if qs.is_cuda and ks.shape[0] != qs.shape[0]:
        # The flash kernel does not take enable_gqa; expanding K/V costs T x heads x D.
        group = qs.shape[0] // ks.shape[0]
        ks, vs, gqa = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0), {}
    return F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, is_causal=causal,
                                          scale=sm_scale, **gqa)[0]


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Causal attention per packed sequence; q [T, num_heads, D], k/v [T, kv_heads, D].

    fp32 math on the CPU (the exact reference); on CUDA in the model dtype, so
    SDPA takes its flash kernel: prefill is compute-bound and fp32 would be
    ~10x slower for no accuracy that bf16 weights could keep.
    """
    return _prefill(q, k, v, cu_seqlens, sm_scale)


def prefill_context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, cache: LayerCache,
    block_tables: torch.Tensor, context_lens: torch.Tensor, sm_scale: float,
) -> torch.Tensor:
    """Chunked prefill: packed chunks q/k/v [T, heads, D] as in prefill_attention, where chunk i
    continues a sequence whose first context_lens[i] tokens are already in the cache.

    Each chunk's queries attend to that context as decode does -- read back from the cache,
    dequantized -- and causally to the chunk's own k/v as given (the engine passes them as
    read_kv returns them); with context_lens all 0 this is prefill_attention. Per-channel keys take k as
    computed (runtime/channel_keys.py rounds a block's own keys to fp16 as its residual stores them), and
    block_tables may be None when every context is empty.
    """
    if cache.fmt.per_channel_keys:
        return channel_keys.prefill(q, k, v, cu_seqlens, cache, block_tables, context_lens.tolist(), sm_scale, _sdpa)
    return _prefill(q, k, v, cu_seqlens, sm_scale, (cache, block_tables, context_lens.tolist()))


def _prefill(q, k, v, cu_seqlens, sm_scale, context=None) -> torch.Tensor:
    """Both prefill ops: per packed sequence i, SDPA of its queries over (the first context[2][i]
    cached tokens, dequantized, then) its own K/V, causal from the bottom right."""
    out = torch.empty_like(q)
    math_dtype = q.dtype if q.is_cuda else torch.float32
    for i, (a, b) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
        if b == a:
            continue
        qs, ks, vs = (t[a:b].transpose(0, 1).to(math_dtype) for t in (q, k, v))
        ctx = context[2][i] if context is not None else 0
        mask = None
        if ctx:
            cache, block_tables, _ = context
            kc, vc = gather_kv(cache, block_tables[i:i + 1], ctx)  # [1, kv_heads, ctx, D] fp32
            ks = torch.cat((kc[0].to(math_dtype), ks), 1)
            vs = torch.cat((vc[0].to(math_dtype), vs), 1)
            # chunk token j (position ctx + j) sees positions 0 .. ctx + j
            mask = torch.ones(b - a, ctx + b - a, dtype=torch.bool, device=q.device).tril(diagonal=ctx)
        out[a:b] = _sdpa(qs, ks, vs, sm_scale, mask).transpose(0, 1).to(q.dtype)
    return out


# ------------------------------------------------------------- backends
OPS = ("write_kv", "decode_attention", "prefill_attention", "prefill_context_attention")


def reference_backend() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="reference", write_kv=write_kv, decode_attention=decode_attention, prefill_attention=prefill_attention,
        prefill_context_attention=prefill_context_attention,
    )


def select_backend(device: torch.device | str, fmt: KVFormat | Sequence[KVFormat] | None = None,
                   prefer: str = "auto") -> types.SimpleNamespace:
    """The attention ops for `device`: Triton kernels on CUDA where they exist, reference elsewhere.

    The kernels package exports any of the OPS (same signatures) and optionally `supports(fmt) -> bool`;
    a missing op or a format some layer uses that it does not support (`fmt`: one format or one
    per layer) falls back to the reference op, so the engine always runs. Every op reads its
    layer's format from the LayerCache, so one backend serves layers of different formats.
    """
    ref = reference_backend()
    formats = [fmt] if isinstance(fmt, KVFormat) else list(fmt or [])
    if prefer == "reference" or torch.device(device).type != "cuda":
        if prefer == "triton":
            from .errors import UnsupportedError

            raise UnsupportedError("attention='triton' needs a CUDA device; use attention='auto' or 'reference'.")
        return ref
    try:
        kernels = importlib.import_module(".kernels", __package__)
    except ImportError:
        return ref
    supports: Callable[[KVFormat], bool] = getattr(kernels, "supports", lambda f: True)
    if not all(supports(f) for f in formats):
        return ref
    ops = {name: getattr(kernels, name, None) for name in OPS}
    chosen = {name: fn if fn is not None else getattr(ref, name) for name, fn in ops.items()}
    used = [n for n, fn in ops.items() if fn is not None]
    backend = types.SimpleNamespace(name="triton(" + ",".join(used) + ")" if used else "reference", **chosen)
    return channel_keys.kernels_backend(backend, ref) if any(f.per_channel_keys for f in formats) else backend
