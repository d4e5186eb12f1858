"""Compile at load what serving would otherwise compile in the middle of a wave.

Triton compiles a kernel the first time a launch meets a new specialization: a plan that the batch and context
choose (tile, split count, ring stages), a bucket (the prefill's chunk lanes, the split merge's lanes, the write's
tokens a program), or an integer argument's class (1, a multiple of 16, other). On the H200 each compile takes
about a second, and the step loop, with every request in flight, waits for it: served from a cold kernel cache,
the first wave of 256 requests got its first tokens after 2.8-6.5 s instead of 0.6 s
(benchmarks/results/served_ttft_kernel_cache.md). So a single-GPU engine, once loaded, runs eager steps of synthetic
batches over the shapes a step can take:

  * one prompt of T tokens, T over the token counts that change a plan or an integer's class;
  * n prefill chunks of one token after a page of context, n over the chunk-lane buckets up to max_batch;
  * b decoding sequences at context L beside one prefill token (decode runs eagerly in a mixed step), b over
    1..max_batch and L over powers of two up to max_seq_len, as long as b * L fits the pool (no real step is
    larger).

CUDA graphs and decode bursts are still captured on their first step (their kernels are among those compiled
here). Integers that change step to step (token and chunk counts, split counts, block-table widths) are not
specialized on (`do_not_specialize` in the kernels), so they add no variants. The synthetic steps
write nothing (slot -1 is skipped by the write kernels) and read block 0; no request exists yet.

`compiles()` counts the kernels this process has compiled (Triton's post-compile hook, a load from the disk
cache included): the engine reports how many were compiled after its warm-up (`EngineStats.serving_compiles`),
0 when the warm-up covered what serving met.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from .config import ceil_div
from .cuda_graphs import can_capture  # whether the write and decode ops are Triton's
from .kv_cache import LayerCache
from .model import LlamaModel, PagedBatch

_count = 0
_recent: deque[str] = deque(maxlen=16)  # the last kernels compiled, for a report


def _on_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # Triton's JITHook
    global _count
    _count += 1
    _recent.append(repr)
    return None


def count_compiles() -> None:
    """Install the counter (once per process; another tool's hook is kept, and called first)."""
    from triton import knobs

    hook = knobs.runtime.jit_post_compile_hook
    if hook is _on_compile or getattr(hook, "kvq_counts", False):
        return
    if hook is None:
        knobs.runtime.jit_post_compile_hook = _on_compile
        return

    def both(**kw):
        hook(**kw)
        return _on_compile(**kw)

    both.kvq_counts = True
    knobs.runtime.jit_post_compile_hook = both


def compiles() -> int:
    return _count


def recent_compiles() -> list[str]:
    return list(_recent)


def token_counts(max_tokens: int, kv_heads: int) -> list[int]:
    """One prompt's token counts: each integer class (1, a multiple of 16, other) on both sides of the write's
    16 * kv_heads threshold, and the step's largest."""
    edge = 16 * kv_heads
    counts = {1, 2, 16, 17, edge, edge + 1, max_tokens}
    return sorted(c for c in counts if c <= max_tokens)


def chunk_counts(max_batch: int) -> list[int]:
    """Chunk counts that reach each chunk-lane bucket (16, 32, ...: runtime/kernels/launch.py's BLOCK_C)."""
    counts, n = {1, 2, max_batch}, 17
    while n <= max_batch:
        counts.add(n)
        n = 2 * n - 1
    return sorted(c for c in counts if c <= max_batch)


def decode_shapes(max_batch: int, max_seq_len: int, pool_tokens: int) -> list[tuple[int, int]]:
    """(sequences, context) of the eager decode steps: batch and context on powers of two (and their limits),
    those that fit the pool."""
    def powers(top: int) -> list[int]:
        vals, v = {1, top}, 2
        while v < top:
            vals.add(v)
            v *= 2
        return sorted(vals)

    contexts = sorted({c + 1 for c in powers(max_seq_len - 1)} | {max_seq_len})
    return [(b, c) for b in powers(max_batch) for c in contexts if b * c <= pool_tokens]


def _batch(dev, ids: int, *, decode: int = 0, context: int = 1, chunks: int = 0, chunk_context: int = 0,
           block_size: int = 16) -> PagedBatch:
    """A step of `decode` sequences at `context` tokens, then either one prompt of `ids - decode` tokens or
    `chunks` one-token chunks after `chunk_context` cached tokens."""
    def full(n, value, dtype=torch.int64):
        return torch.full((n,), value, dtype=dtype, device=dev)

    prefill = ids - decode
    cu = torch.arange(chunks + 1, dtype=torch.int32, device=dev) if chunks else \
        torch.tensor([0, prefill], dtype=torch.int32, device=dev)
    positions = torch.cat((full(decode, context - 1), full(prefill, chunk_context) if chunks
                           else torch.arange(prefill, dtype=torch.int64, device=dev)))
    width, ctx_width = ceil_div(context, block_size), ceil_div(chunk_context + 1, block_size)
    return PagedBatch(
        input_ids=full(ids, 1), positions=positions, slot_mapping=full(ids, -1), num_decode=decode,
        block_tables=torch.zeros((decode, width), dtype=torch.int32, device=dev),
        seq_lens=full(decode, context, torch.int32), cu_seqlens=cu,
        logits_indices=torch.cat((torch.arange(decode, device=dev), decode + cu[1:].long() - 1)),
        max_position=max(context - 1, chunk_context, prefill - 1 if not chunks else 0),
        context_lens=full(chunks, chunk_context, torch.int32) if chunks else None,
        prefill_block_tables=torch.zeros((chunks, ctx_width), dtype=torch.int32, device=dev) if chunks else None,
    )


@torch.inference_mode()
def applies(model: LlamaModel, backend, formats, *, tensor_parallel: bool, batch_invariant: bool) -> bool:
    """Whether an engine warms up: a single CUDA device on the Triton ops, where the synthetic steps are inert.
    Not with per-channel keys (per-request residual state), the batch-invariant prefill (it reads the step's
    K/V back from its slots) or tensor parallelism (a step needs every rank)."""
    return (model.device.type == "cuda" and can_capture(backend) and not tensor_parallel and not batch_invariant
            and not any(f.per_channel_keys for f in formats))


def warm_up(model: LlamaModel, caches: list[LayerCache], backend, *, max_batch: int, max_seq_len: int,
            max_tokens_per_step: int, pool_tokens: int) -> float:
    """Run the synthetic steps; returns the seconds they took."""
    t0 = time.perf_counter()
    dev, bs = model.device, caches[0].block_size
    steps = [_batch(dev, t, block_size=bs) for t in token_counts(max_tokens_per_step, model.cfg.num_kv_heads)]
    steps += [_batch(dev, n, chunks=n, chunk_context=bs, block_size=bs) for n in chunk_counts(max_batch)
              if n * (bs + 1) <= pool_tokens]
    steps += [_batch(dev, b + 1, decode=b, context=c, block_size=bs)
              for b, c in decode_shapes(max_batch, max_seq_len, pool_tokens) if b + 1 <= max_tokens_per_step]
    for step in steps:
        model.forward_paged(step, caches, backend)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0
