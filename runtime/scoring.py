"""Teacher-forced scoring through the engine: `Engine.score`.

Each sequence ("window") is prefilled through the engine's own path -- pages
from its block manager, `ModelRunner.build_batch`, quantize-on-write into the
paged pool, its attention backend and kernels, its chunked prefill when a
window is longer than the step budget -- with logits kept at every position
instead of the last one only. Windows are packed into passes of at most
`tokens_per_pass` tokens, several windows per pass, so scoring 8 x 1024
tokens costs a few batched forwards rather than 8k decode steps.

Because every attention over cached tokens reads the values as stored (the
engine's one numerics, design.md), one prefill pass over a window computes
what token-by-token decode computes: the scores are those of the served model.

`attention_through_cache` is the per-layer view of the same path: a layer's
queries attend to K/V written into, and read back from, the engine's pool by
the decode op, next to the exact attention over the unquantized K/V.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .attention import read_kv
from .errors import NumericsError, RequestError
from .sampling import SamplingParams
from .scheduler import Sequence, Step

_keys = itertools.count()
_LOGSOFTMAX_ROWS = 512  # rows of [rows, vocab] fp32 converted at a time: bounds the extra memory


@dataclass
class TokenScores:
    """Scores of one sequence's positions start .. T-1."""

    start: int  # first scored position: logprobs[i] is log p(ids[start + i] | ids[:start + i])
    logprobs: torch.Tensor  # [T - start] fp32, on the CPU
    argmax: torch.Tensor  # [T - start] int64: the model's most likely token at each of those positions

    def matches(self, ids: Seq[int] | torch.Tensor) -> torch.Tensor:
        """[T - start] bool: where greedy decoding would have produced the given token."""
        target = torch.as_tensor(ids, dtype=torch.int64)[self.start :]
        return self.argmax == target


@dataclass
class _Window:
    seq: Sequence
    start: int  # first scored position
    index: int  # position in the caller's list
    done: int = 0  # tokens already prefilled
    logprobs: list[torch.Tensor] = field(default_factory=list)  # per pass
    argmax: list[torch.Tensor] = field(default_factory=list)


def validate_windows(sequences: Seq[Seq[int]], start: int | Seq[int], vocab_size: int,
                     max_seq_len: int, max_blocks: int, blocks_for: Callable[[int], int]) -> list[tuple[list[int], int]]:
    """(ids, start) per window; every bad window is a RequestError naming the field, before any work."""
    if isinstance(sequences, (str, bytes)) or not len(sequences):
        raise RequestError("score needs a non-empty list of token-id sequences (`sequences`).")
    starts = [start] * len(sequences) if isinstance(start, int) else list(start)
    if len(starts) != len(sequences):
        raise RequestError(f"`start` has {len(starts)} entries for {len(sequences)} sequences; give one per sequence.")
    out = []
    for n, (ids, s) in enumerate(zip(sequences, starts)):
        ids = [int(t) for t in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        if len(ids) < 2:
            raise RequestError(f"sequences[{n}] has {len(ids)} tokens; scoring needs at least 2.")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise RequestError(f"sequences[{n}] has token ids outside [0, {vocab_size}); check the tokenizer.")
        if len(ids) > max_seq_len:
            raise RequestError(f"sequences[{n}] has {len(ids)} tokens, more than max_seq_len {max_seq_len}; "
                               "cut it into shorter windows.")
        if blocks_for(len(ids)) > max_blocks:
            raise RequestError(f"sequences[{n}] ({len(ids)} tokens) needs {blocks_for(len(ids))} KV blocks, the pool "
                               f"has {max_blocks}; give the engine more KV memory or score shorter windows.")
        if not 1 <= int(s) < len(ids):
            raise RequestError(f"start[{n}] = {s} must be in [1, {len(ids) - 1}] for a {len(ids)}-token sequence.")
        out.append((ids, int(s)))
    return out


def _gather_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits)[targets] and argmax per row, a slice of rows at a time."""
    lps, arg = [], []
    for a in range(0, logits.shape[0], _LOGSOFTMAX_ROWS):
        rows = logits[a : a + _LOGSOFTMAX_ROWS]
        t = targets[a : a + _LOGSOFTMAX_ROWS]
        lps.append(rows.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(rows, -1))
        arg.append(rows.argmax(-1))
    if not lps:  # a pass over the unscored context before every window's start
        return logits.new_empty(0), torch.empty(0, dtype=torch.int64, device=logits.device)
    return torch.cat(lps), torch.cat(arg)


def score(engine, sequences: Seq[Seq[int]], start: int | Seq[int] = 1, tokens_per_pass: int | None = None,
          on_pass: Callable[[int], None] | None = None,
          exclusive: Callable[..., Any] | None = None) -> list[TokenScores]:
    """Teacher-forced scores of every window through `engine` (runtime.engine.Engine).

    tokens_per_pass: tokens per forward (default: the engine's max_tokens_per_step); a longer window is
    prefilled in chunks, each later chunk reading the earlier ones from the cache. on_pass(n) is called
    after every pass with the number of tokens it ran (progress bars). exclusive(fn): runs each pass
    (`Engine.exclusive`: between the step loop's steps, where they run), so the engine's step loop and
    scoring never touch the pool at the same time.
    """
    blocks, runner = engine.blocks, engine.runner
    windows = validate_windows(sequences, start, engine.cfg.vocab_size, engine.max_seq_len, blocks.num_blocks,
                               blocks.blocks_for)
    budget = int(tokens_per_pass or engine.scheduler.max_tokens_per_step)
    if budget < 1:
        raise RequestError(f"tokens_per_pass must be >= 1, got {tokens_per_pass}.")
    results: list[TokenScores | None] = [None] * len(windows)
    pending = list(range(len(windows)))
    active: list[_Window] = []
    # per-channel keys keep a window's open block in an fp16 residual block, sized by the engine's batch
    at_once = engine.scheduler.max_batch_size if any(f.per_channel_keys for f in engine.formats) else len(windows)

    @torch.inference_mode()
    def one_pass() -> int:
        while pending and len(active) < at_once and blocks.can_allocate(len(windows[pending[0]][0])):
            n = pending.pop(0)
            ids, s = windows[n]
            w = _Window(Sequence(("score", next(_keys)), ids, SamplingParams(max_tokens=1)), s, n)
            blocks.allocate(w.seq.request_id, len(ids))
            active.append(w)
        if not active:
            return 0
        finished, ran = _run_pass(runner, _plan_pass(active, budget))
        for w in finished:
            blocks.free(w.seq.request_id)
            active.remove(w)
            results[w.index] = TokenScores(w.start, torch.cat(w.logprobs), torch.cat(w.argmax))
        return ran

    def release() -> None:
        for w in active:
            blocks.free(w.seq.request_id)

    run = exclusive or (lambda fn: fn())
    try:
        while pending or active:
            ran = run(one_pass)
            if not active and pending:  # the step loop holds the pages: let it run, then retry
                threading.Event().wait(0.01)
            elif on_pass is not None:
                on_pass(ran)
    finally:
        run(release)
    return results  # type: ignore[return-value]


def _plan_pass(active: list[_Window], budget: int) -> list[tuple[_Window, tuple[int, int]]]:
    """The next chunk of each active window, oldest first, until the pass holds `budget` tokens."""
    chunks, left = [], budget
    for w in active:
        if left == 0:
            break
        end = min(w.seq.num_tokens, w.done + left)
        chunks.append((w, (w.done, end)))
        left -= end - w.done
    return chunks


def _run_pass(runner, chunks: list[tuple[_Window, tuple[int, int]]]) -> tuple[list[_Window], int]:
    """One forward over the chunks; each window keeps its chunk's scores. Returns the windows this pass
    finished and the number of tokens it ran."""
    step = Step(decode=[], prefill=[w.seq for w, _ in chunks], spans=[span for _, span in chunks])
    batch = runner.build_batch(step)
    # Logits only where a scored token is predicted: position p predicts token p + 1.
    rows, targets, counts, offset = [], [], [], 0
    for w, (b, e) in chunks:
        first, last = max(b, w.start - 1), min(e, w.seq.num_tokens - 1)
        rows.extend(range(offset + first - b, offset + last - b))
        targets.extend(w.seq.prompt_ids[first + 1 : last + 1])
        counts.append(max(0, last - first))
        offset += e - b
    batch = replace(batch, logits_indices=torch.tensor(rows, dtype=torch.int64).to(runner.device))
    logits = runner.forward(batch)
    if not bool(torch.isfinite(logits).all()):
        raise NumericsError("the model produced NaN/Inf logits while scoring; check the weights (convert stage) "
                            "or the KV scales (calibrate stage).")
    lp, am = _gather_scores(logits, torch.tensor(targets, dtype=torch.int64, device=logits.device))
    lp, am = lp.cpu(), am.cpu()
    finished, offset = [], 0
    for (w, (_, e)), n in zip(chunks, counts):
        w.logprobs.append(lp[offset : offset + n])
        w.argmax.append(am[offset : offset + n])
        offset += n
        w.done = e
        if e == w.seq.num_tokens:
            finished.append(w)
    return finished, sum(e - b for _, (b, e) in chunks)


def attention_through_cache(engine, layer: int, h: torch.Tensor, query_block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s attention over one sequence's input hidden states h [T, hidden], two ways:
    (read back, exact). Read back: K/V written into the engine's pool (quantize-on-write) and every
    position's query attending, as a decode step does, to the first t + 1 stored tokens. Exact: causal
    attention over the unquantized K/V. Both [T, heads, head_dim] fp32. One pass between the step
    loop's steps, like score's (`Engine.exclusive`)."""
    return engine.exclusive(_attention_through_cache, engine, layer, h, query_block)


@torch.inference_mode()
def _attention_through_cache(engine, layer: int, h: torch.Tensor, query_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    model = engine.model
    t = h.shape[0]
    positions = torch.arange(t, device=model.device)
    cos, sin = model.rotary.cos_sin(positions, model.dtype)
    q, k, v = model._qkv(model.layer(layer), h.to(model.device, model.dtype), cos, sin)
    cu = torch.tensor([0, t], dtype=torch.int32, device=model.device)
    exact = engine.backend.prefill_attention(q, k, v, cu, model.sm_scale).to(torch.float32)
    return _read_back(engine, layer, q, k, v, exact, query_block)


def _read_back(engine, layer: int, q, k, v, exact: torch.Tensor, query_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    model, blocks = engine.model, engine.blocks
    t = q.shape[0]
    key = ("attention", next(_keys))
    if blocks.blocks_for(t) > blocks.num_free_blocks:
        raise RequestError(f"{t} tokens need {blocks.blocks_for(t)} free KV blocks, the pool has "
                           f"{blocks.num_free_blocks}; use fewer attention tokens or more KV memory.")
    blocks.allocate(key, t)
    try:
        table = blocks.block_table(key)
        bs = blocks.block_size
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(t)], dtype=torch.int64, device=model.device)
        cache = engine.runner.caches[layer]
        engine.backend.write_kv(cache, k, v, slots)
        read = torch.empty_like(exact)
        tables = torch.tensor(table, dtype=torch.int32, device=model.device)
        if cache.fmt.per_channel_keys:  # the write left only the last block's fp16 keys: attend as a prompt does
            cu, ctx = torch.tensor([0, t], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            stored_v = read_kv(cache, slots, v.dtype)[1]
            read[:] = engine.backend.prefill_context_attention(q, k, stored_v, cu, cache, tables[None], ctx,
                                                               model.sm_scale)
            return read, exact
        for a in range(0, t, query_block):
            b = min(t, a + query_block)
            lens = torch.arange(a + 1, b + 1, dtype=torch.int32, device=model.device)
            read[a:b] = engine.backend.decode_attention(q[a:b], cache, tables.expand(b - a, -1).contiguous(), lens,
                                                        model.sm_scale).to(torch.float32)
    finally:
        blocks.free(key)
    return read, exact
