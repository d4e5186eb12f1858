"""The batch-invariant mode's attention on CUDA: one computation for decode, prefill and chunked prefill.

A query row's result must depend only on its query, its own length and its own stored keys, never on the
batch around it, so that a token's K/V (hence its codes in a quantized cache) are the same alone, among 63
others, in a chunk of any size, and recomputed after preemption, where the tokens a request generated in
decode steps are prefilled again. The default kernels plan by the batch: the kernel, its tile and the
split-K count follow the batch size and the block table's width (its longest sequence), and a prompt runs
another kernel than decode.

Here every row, decode or prefill, runs kvq's own decode kernel with ONE plan per (KV format, head layout,
page size, q dtype, device), the default's choice for a fixed reference shape (on the H200 the Gluon kernel
for the quantized formats, decode_gluon.py; elsewhere and under the interpreter the Triton ones,
decode_warps.py / decode_tiles.py / decode_mixed.py), with splits of SPLIT_TOKENS keys at fixed offsets: split j
of every row covers keys j * SPLIT_TOKENS .. (j + 1) * SPLIT_TOKENS - 1 (up to its length), in tiles of the plan's
fixed size, in order, each tile's dequantization as the plan says, and a row's own splits are merged one after
another from the first (`split_k.merge_in_order`). The launch has as many splits as the widest table needs; a
row's result depends on its own length only, never on that count. A prefill token is such a row too: its keys
are already in the cache (write, then read: model._attend writes the step's K/V first), so it attends to
positions 0 .. its own, through its sequence's pages, with the same splits, tiles, roundings and order as the
decode step that would have computed it. One long context alone gets (KV head, split) programs enough to fill
the GPU (docs/numerics.md §CUDA).
"""

from __future__ import annotations

import dataclasses
import functools
import types

import torch

from ..attention import prefill_attention
from ..kv_cache import LayerCache
from . import invariant_gemm, launch, small_ops
from .plan import DecodePlan, decode_plan, split_tile
from .split_k import fixed_split_count
from .tuned_file import device_of

# the reference shape of the one plan: many sequences of a long context, so the plan's rules take their
# steady choices (the per-format tuned tile, never the few-programs variant)
PLAN_BATCH = 256
PLAN_TOKENS = 8192
# keys a split: one 8k sequence makes 16 splits a KV head (128 programs at Llama-3-8B's 8 KV heads), while at maximum
# concurrency a split's partial (a GQA group's m, l and fp32 acc) stays ~2% of the KV bytes it reads.
# why: of 512 / 1024 / 2048 on an H100 (Llama-3-8B, batch 1 at 8k and 32k, max concurrency at 8k; BF16, FP8,
# INT4, K8V4), 512 kept every scenario at >= 0.90x the default step, 1024 >= 0.81x, 2048 >= 0.67x (docs/numerics.md)
SPLIT_TOKENS = 512
# fp32 split partials (m, l and acc of every row, query head and split) one launch may hold: rows beyond go in more
# launches, so that a wide table -- a prompt's tokens as rows over a 32k context, one 128k sequence among hundreds --
# costs bounded memory (256 MB); rows are independent, so this changes no bits
PARTIAL_VALUES = 2**26


@functools.cache
def _plan(fmt, device, heads: int, kv_heads: int, head_dim: int, block_size: int, q_dtype: torch.dtype) -> DecodePlan:
    plan = decode_plan(fmt, PLAN_BATCH, heads, kv_heads, PLAN_TOKENS, device, head_dim=head_dim,
                       block_size=block_size, q_dtype=q_dtype)
    tile = split_tile(plan)
    return dataclasses.replace(plan, splits=1, split_tokens=-(-SPLIT_TOKENS // tile) * tile)


def row_plan(q: torch.Tensor, cache: LayerCache) -> DecodePlan:
    """The one plan of every row of this cache's layers with q of this dtype and head count."""
    _, kv_heads, bs, _ = cache.k.shape
    return _plan(cache.fmt, device_of(q.device), q.shape[1], kv_heads, q.shape[2], bs, q.dtype)


def decode_attention(q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float) -> torch.Tensor:
    """runtime/attention.py's decode op, each row through `row_plan` (no host sync: CUDA graphs capture it), rows in
    launches whose split partials stay within PARTIAL_VALUES."""
    plan = row_plan(q, cache)
    splits = fixed_split_count(block_tables.shape[1] * cache.k.shape[2], plan.split_tokens)
    rows = max(1, PARTIAL_VALUES // (splits * q.shape[1] * (q.shape[2] + 2)))
    if q.shape[0] <= rows:
        return launch.decode_attention(q, cache, block_tables, seq_lens, sm_scale, plan=plan)
    return torch.cat([launch.decode_attention(q[a:a + rows], cache, block_tables[a:a + rows], seq_lens[a:a + rows],
                                              sm_scale, plan=plan) for a in range(0, q.shape[0], rows)])


def _prefill_rows(cu_seqlens: torch.Tensor, context_lens: torch.Tensor | None, tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk of every prefill token [T] int64, keys it sees [T] int32: its context, its chunk up to itself)."""
    dev = cu_seqlens.device
    idx = torch.arange(tokens, dtype=torch.int32, device=dev)
    chunk = torch.searchsorted(cu_seqlens[1:].contiguous(), idx, right=True)
    lens = idx - cu_seqlens[chunk] + 1
    if context_lens is not None:
        lens = lens + context_lens[chunk]
    return chunk, lens.to(torch.int32)


def _own_tables(slot_mapping: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int, tokens: int) -> torch.Tensor:
    """Block tables of chunks that start their sequence (no context): page j of chunk i holds its tokens
    j * block_size .., so its page is that token's slot // block_size; [chunks, ceil(T / block_size)] int32.
    Entries past a chunk's end are masked by its rows' lengths."""
    width = -(-tokens // block_size)
    first = cu_seqlens[:-1].long()[:, None] + torch.arange(width, device=slot_mapping.device)[None, :] * block_size
    return (slot_mapping[first.clamp_max(tokens - 1)] // block_size).to(torch.int32)


def prefill_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              cache: LayerCache, block_tables: torch.Tensor, context_lens: torch.Tensor | None,
                              sm_scale: float) -> torch.Tensor:
    """runtime/attention.py's chunked-prefill op, every token a decode row over its sequence's pages (k and v
    are the step's, already written; the op reads them back from the cache, as decode does)."""
    tokens = q.shape[0]
    if tokens == 0:
        return torch.empty_like(q)
    chunk, lens = _prefill_rows(cu_seqlens, context_lens, tokens)
    return decode_attention(q, cache, block_tables.index_select(0, chunk), lens, sm_scale)


def prefill_from_cache(q: torch.Tensor, cache: LayerCache, batch, sm_scale: float) -> torch.Tensor:
    """The prefill rows' attention of a step (model.PagedBatch `batch`; q [prefill tokens, heads, D]) through
    the cache: chunks with context use the step's block tables, whole prompts their own slots' pages."""
    tokens = q.shape[0]
    if tokens == 0:
        return torch.empty_like(q)
    tables = batch.prefill_block_tables
    if tables is None:
        tables = _own_tables(batch.slot_mapping[batch.num_decode:], batch.cu_seqlens, cache.block_size, tokens)
    return prefill_context_attention(q, None, None, batch.cu_seqlens, cache, tables, batch.context_lens, sm_scale)


def backend() -> types.SimpleNamespace:
    """The batch-invariant mode's ops on CUDA: Triton write, the row-planned decode kernel for every attention
    row, the fixed-config GEMM, and the small ops (one program per row: RMSNorm's sum of squares in one order
    whatever the row count). prefill_attention (over given K/V, not the cache) is the reference op: the mode's
    engine steps never call it (model.LlamaModel._prefill takes `prefill_from_cache`); scoring's exact
    attention does."""
    return types.SimpleNamespace(
        name="batch-invariant(triton)", write_kv=launch.write_kv, decode_attention=decode_attention,
        prefill_attention=prefill_attention, prefill_context_attention=prefill_context_attention,
        prefill_from_cache=prefill_from_cache, linear=invariant_gemm.linear, small_ops=small_ops,
    )
