"""Continuous batching: which sequences run in the next step.

Every step first gives each running sequence room for one decode token
(oldest first); when the pool is out of blocks the newest running sequence is
preempted -- its blocks freed, its prompt plus the tokens it generated so far
queued at the front to be recomputed by a later prefill. Then waiting requests
are admitted as prefills while the batch, the per-step token budget and the
free blocks allow, so new requests join while others decode, in the same step.
A prompt that does not fit the step's remaining budget is prefilled in chunks
over several steps (chunked prefill): each chunk attends to the earlier chunks
through the KV cache, decoding sequences keep stepping meanwhile, and the first
token is sampled when the last chunk has run. A sequence holds the blocks for
its whole prompt from admission, so a chunked prefill never waits on memory
halfway.

With prefix caching (block_manager.py) an admitted sequence -- new, or
re-admitted after preemption -- takes the cached pages that start its tokens
and its prefill starts at the first uncached token; a chunk reads the cached
pages exactly as decode does (write-then-read, docs/numerics.md). `commit`
registers the pages a step filled, once its forward has written them.

Recompute (rather than swapping pages out) keeps the pool the only KV memory
and costs one prefill per preemption; the oldest request always progresses,
so nothing starves.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .block_manager import BlockManager
from .sampling import SamplingParams

TokenCallback = Callable[[int | None, bool, str | None], None]

_arrivals = itertools.count()


@dataclass(frozen=True)
class KVCacheUsage:
    """One request's KV pages, over all its admissions (tensorrt_llm's kv_cache_* outputs)."""

    reused_blocks: int  # taken from the prefix cache
    new_blocks: int  # allocated fresh for its prompt
    cached_tokens: int  # prompt tokens whose prefill the cache skipped (first admission)

    @property
    def total_blocks(self) -> int:
        return self.reused_blocks + self.new_blocks


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    on_token: TokenCallback | None = None
    on_finish: Callable[[KVCacheUsage], None] | None = None  # gets kv_cache_usage when it finishes
    output_ids: list[int] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrivals))
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    error: Exception | None = None  # why the engine failed this request (finish_reason "error")
    logprobs: list[float] = field(default_factory=list)  # per output token, when sampling.logprobs
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    prefill_target: int = 0  # tokens to prefill (set at admission); decoding once num_computed reaches it
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache at its first admission
    reused_blocks: int = 0  # KV pages taken from the prefix cache, over all its admissions
    new_blocks: int = 0  # KV pages allocated fresh, over all its admissions

    @property
    def kv_cache_usage(self) -> KVCacheUsage:
        return KVCacheUsage(self.reused_blocks, self.new_blocks, self.cached_tokens)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_target


@dataclass
class Step:
    decode: list[Sequence]
    prefill: list[Sequence]
    spans: list[tuple[int, int]]  # per prefill sequence, the token range [start, end) this step computes

    @property
    def completed_prefill(self) -> list[Sequence]:
        """Prefill sequences whose last chunk runs in this step: they get their first token."""
        return [s for s, (_, end) in zip(self.prefill, self.spans) if end == s.num_tokens]

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a token from this step, in the order of the step's logits."""
        return self.decode + self.completed_prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(end - start for start, end in self.spans)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, max_tokens_per_step: int):
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.max_tokens_per_step = max_tokens_per_step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order: the last one is the newest
        self.num_preemptions = 0
        # Admit a new prefill only if this many blocks stay free for the running sequences'
        # next decode tokens (vLLM's 1% watermark): otherwise a fresh prefill is preempted
        # again on the very next step and its compute wasted.
        self.watermark_blocks = max(1, blocks.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.request_id)
        seq.num_computed = seq.prefill_target = 0  # recomputed from scratch
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> Step:
        decode: list[Sequence] = []
        # sequences halfway through a chunked prefill hold their blocks and wait for budget below
        chunking = [s for s in self.running if s.prefilling]
        queue = deque(s for s in self.running if not s.prefilling)
        while queue:
            seq = queue.popleft()
            while not self.blocks.can_append(seq.request_id):
                # the newest running sequence gives its blocks back: a decoding one, or one halfway
                # through a chunked prefill (it holds its whole prompt's blocks) if that is newer
                if chunking and chunking[-1].arrival > max(seq.arrival, queue[-1].arrival if queue else -1):
                    self._preempt(chunking.pop())
                elif queue:
                    self._preempt(queue.pop())
                else:
                    self._preempt(seq)
                    seq = None
                    break
            if seq is not None:
                self.blocks.append(seq.request_id)
                seq.num_computed = seq.num_tokens  # this step computes its newest token's K/V
                decode.append(seq)
        self.running = decode + chunking

        prefill: list[Sequence] = []
        spans: list[tuple[int, int]] = []
        budget = self.max_tokens_per_step - len(decode)

        def take(seq: Sequence) -> None:
            nonlocal budget
            start = seq.num_computed
            end = min(seq.prefill_target, start + budget)
            prefill.append(seq)
            spans.append((start, end))
            seq.num_computed = end
            budget -= end - start

        for seq in chunking:  # started prefills first, oldest first
            if budget <= 0:
                break
            take(seq)
        while self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.waiting[0]
            tokens = seq.token_ids
            reserve = self.watermark_blocks if self.running else 0
            if self.blocks.blocks_needed(tokens) + reserve > self.blocks.num_free_blocks:
                break
            cached = self.blocks.allocate_prefix(seq.request_id, tokens)
            reused = self.blocks.num_reused_blocks(seq.request_id)
            if not seq.preemptions:
                seq.cached_tokens = cached
            seq.reused_blocks += reused
            seq.new_blocks += self.blocks.blocks_for(len(tokens)) - reused
            self.waiting.popleft()
            self.running.append(seq)
            seq.num_computed = cached
            seq.prefill_target = len(tokens)
            take(seq)  # the uncached rest of the prompt, or the chunk the budget leaves
        # Keep arrival order, so a recomputed old request is not mistaken for the newest.
        self.running.sort(key=lambda s: s.arrival)
        return Step(decode, prefill, spans)

    def commit(self, step: Step) -> None:
        """The step's forward wrote its K/V: its sequences' newly full pages become cacheable."""
        if not self.blocks.prefix_caching:
            return
        bs = self.blocks.block_size
        for seq in step.decode + step.prefill:
            # most decode steps fill no page: skip building the token list for them
            if seq.request_id in self.blocks and seq.num_computed // bs > self.blocks.num_keyed_blocks(seq.request_id):
                self.blocks.mark_computed(seq.request_id, seq.token_ids, seq.num_computed)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Drop a sequence (done, cancelled or failed) and give back its blocks."""
        seq.finish_reason = reason
        self.blocks.free(seq.request_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
