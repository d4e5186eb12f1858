"""One engine step and what follows it: schedule, run the model, sample, stop checks, callbacks.

The engine (runtime/engine.py) owns the requests and the background thread; this module owns what
happens to the running sequences in one step. Failures are isolated per request: a forward that
raises fails the step's requests only, and a row whose logits, sampling or stop checks go wrong ends
that request alone while the others keep their tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .block_manager import BlockManager
from .config import ModelConfig
from .decode_burst import DecodeBurst, PendingBurst
from .errors import KvqError, NumericsError
from .runner import ModelRunner
from .sampling import select_tokens
from .scheduler import Scheduler, Sequence, Step

log = logging.getLogger("kvq.engine")


@dataclass
class EngineStats:
    device: str
    dtype: str
    kv_format: str
    attention: str
    weight_bytes: int
    pool_blocks: int
    block_size: int
    pool_tokens: int
    pool_bytes: int
    kv_bytes_per_token: float
    pool_source: str
    pool_allocated_bytes: int = 0  # measured: every layer's page + per-token metadata tensors
    cuda_graphs: bool = False  # decode steps replay CUDA graphs (runtime/cuda_graphs.py)
    batch_invariant: bool = False  # outputs independent of the batch (runtime/batch_invariant.py)
    step_batch_sizes: list[int] = field(default_factory=list)
    step_num_tokens: list[int] = field(default_factory=list)
    preemptions: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefix_caching: bool = False  # full KV pages reused across requests (runtime/block_manager.py)
    prefix_lookups: int = 0  # full prompt pages looked up in the prefix cache
    prefix_hits: int = 0  # of those, found cached
    prefix_hit_rate: float = 0.0  # prefix_hits / prefix_lookups
    reused_tokens: int = 0  # prompt tokens whose prefill the cache skipped
    evictions: int = 0  # cached pages evicted for new data
    kv_rotation: str = "none"  # K/V rotated before they are stored (runtime/rotation.py)
    burst_steps: int = 0  # greedy decode steps per host read-back (runtime/decode_burst.py); 0: every step
    fused_ops: bool = False  # norms, RoPE and SwiGLU as fused Triton kernels (runtime/kernels/small_ops.py)
    warm_up_s: float = 0.0  # the load's synthetic steps (runtime/warmup.py)
    serving_compiles: int = 0  # kernels this process compiled after the warm-up, while serving: 0 is the goal

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class StepLoop:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, blocks: BlockManager, stats: EngineStats,
                 cfg: ModelConfig, max_seq_len: int, live: dict[int, Sequence], cancel: Callable[[int], None],
                 burst: DecodeBurst | None = None):
        self.runner, self.scheduler, self.blocks, self.stats = runner, scheduler, blocks, stats
        self.burst = burst  # greedy decode-only steps run as device-resident bursts (runtime/decode_burst.py)
        self.cfg, self.max_seq_len = cfg, max_seq_len
        self.live = live  # the engine's requests in flight by id; a finished one leaves it here
        self.cancel = cancel  # the engine's cancel: a broken callback cancels its own request

    def step(self) -> None:
        steps = self._burst_steps()
        if steps:
            self._run_burst(steps)
            return
        step = self.scheduler.schedule()
        if not step:
            return
        try:
            logits = self.runner.run(step)
        except Exception as e:  # noqa: BLE001 - the forward is shared: fail this step's requests only
            self.fail(list(step.decode) + list(step.prefill), e)
            return
        self.scheduler.commit(step)  # K/V written: the step's full pages become reusable
        seqs = step.sampled  # a prefill chunk that is not its prompt's last gets no token
        eos = () if self.cfg.eos_token_id is None else (self.cfg.eos_token_id,)
        picks = select_tokens(logits, seqs, eos)
        st = self.stats
        st.step_batch_sizes.append(len(step.decode) + len(step.prefill))
        st.step_num_tokens.append(step.num_tokens)
        st.prompt_tokens += sum(len(s.prompt_ids) for s in step.completed_prefill if not s.preemptions)
        st.generated_tokens += len(seqs)
        self._cache_stats()
        for seq, pick in zip(seqs, picks):
            # Whatever goes wrong with one request (its logits, sampling, stop checks) ends that request
            # alone: its blocks are freed and every other sequence keeps its step.
            try:
                if pick.error is not None:
                    raise pick.error
                seq.output_ids.append(pick.token)
                if seq.sampling.logprobs:
                    seq.logprobs.append(pick.logprob)
                reason = self.finish_reason(seq, pick.token)
            except Exception as e:  # noqa: BLE001
                self.fail([seq], e)
                continue
            if reason is not None:
                self.scheduler.finish(seq, reason)
            self.emit(seq, pick.token, reason)

    def _cache_stats(self) -> None:
        st, cs = self.stats, self.blocks.cache_stats
        st.preemptions = self.scheduler.num_preemptions
        st.prefix_lookups, st.prefix_hits, st.prefix_hit_rate = cs.lookups, cs.hits, cs.hit_rate
        st.reused_tokens, st.evictions = cs.reused_tokens, cs.evictions

    def _burst_steps(self) -> int:
        """How many steps the next burst runs; 0 where the next step must be an ordinary one: a
        prefill is waiting or running, a row needs its logits on the host (sampling, penalties,
        log-probs), or the pool lacks the burst's pages (the ordinary step preempts)."""
        sched, burst = self.scheduler, self.burst
        if burst is None or sched.waiting or not sched.running or len(sched.running) > burst.max_batch:
            return 0
        if any(s.prefilling or not s.sampling.greedy or s.sampling.adjusts_logits or s.sampling.logprobs
               for s in sched.running):
            return 0
        steps = min([burst.steps] + [min(s.sampling.max_tokens - len(s.output_ids), self.max_seq_len - s.num_tokens)
                                     for s in sched.running])
        # pages the burst's tokens open (a sequence holds pages for its tokens but the newest, whose K/V the
        # next step writes), plus one per sequence for a shared last page's copy
        needed = sum(self.blocks.blocks_for(s.num_tokens - 1 + steps) - len(self.blocks.block_table(s.request_id))
                     for s in sched.running)
        return steps if steps >= 1 and needed + len(sched.running) <= self.blocks.num_free_blocks else 0

    def _run_burst(self, steps: int) -> None:
        seqs = list(self.scheduler.running)
        for seq in seqs:
            self.blocks.append_tokens(seq.request_id, steps)
        try:
            # a decoding sequence's newest token is its last output (token_ids would copy the whole prompt)
            pending = self.burst.launch([s.output_ids[-1] for s in seqs], [s.num_tokens - 1 for s in seqs],
                                        [self.blocks.block_table(s.request_id) for s in seqs], steps)
        except Exception as e:  # noqa: BLE001 - the forward is shared: fail these requests only
            self.fail(seqs, e)
            return
        self._finish_burst(pending, seqs)

    def _finish_burst(self, pending: PendingBurst, seqs: list[Sequence]) -> None:
        """pending's tokens into its sequences."""
        steps = pending.steps
        try:
            tokens, finite = pending.read()
        except Exception as e:  # noqa: BLE001
            self.fail(seqs, e)
            return
        st = self.stats
        st.step_batch_sizes += [len(seqs)] * steps
        st.step_num_tokens += [len(seqs)] * steps
        # sequence by sequence (each one's tokens in step order: its stream is the ordinary step's): one that
        # cannot stop inside the burst takes its tokens at once, the others token by token
        for seq, seq_tokens, seq_finite in zip(seqs, zip(*tokens), zip(*finite)):
            if seq.finished:  # stopped in the burst before, or cancelled since: these tokens are dropped
                continue
            if all(seq_finite) and not self._may_stop(seq, seq_tokens):
                seq.output_ids += seq_tokens
                seq.num_computed = seq.num_tokens - 1  # the newest token's K/V the next step writes
                st.generated_tokens += steps
                if seq.on_token is not None:
                    for tok in seq_tokens:
                        self.emit(seq, tok, None)
                continue
            self._take_tokens(seq, seq_tokens, seq_finite)
        self.scheduler.commit(Step([s for s in seqs if not s.finished], [], []))
        self._cache_stats()

    def _may_stop(self, seq: Sequence, tokens: tuple[int, ...]) -> bool:
        """Whether `finish_reason` could end seq at one of `tokens` (the next ones it gets): `finish_reason`'s
        conditions for all of them at once, in C-level set and length checks instead of a call a token."""
        sp, n = seq.sampling, len(tokens)
        if len(seq.output_ids) + n >= sp.max_tokens or seq.num_tokens + n >= self.max_seq_len or sp.stop_sequences:
            return True
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos and self.cfg.eos_token_id is not None:
            stops.add(self.cfg.eos_token_id)
        return not stops.isdisjoint(tokens)

    def _take_tokens(self, seq: Sequence, tokens: tuple[int, ...], finite: tuple[bool, ...]) -> None:
        """A burst's tokens for seq one by one: stop checks after each, the rest dropped after a stop."""
        for tok, ok in zip(tokens, finite):
            if seq.finished:  # stopped earlier in the burst: its later tokens are dropped
                return
            seq.num_computed = seq.num_tokens
            try:
                if not ok:
                    raise NumericsError("the model produced NaN/Inf logits for this request; its output is "
                                        "unusable. Check the engine's KV scales and weights (kvq eval).")
                seq.output_ids.append(tok)
                reason = self.finish_reason(seq, tok)
            except Exception as e:  # noqa: BLE001
                self.fail([seq], e)
                continue
            self.stats.generated_tokens += 1
            if reason is not None:
                self.scheduler.finish(seq, reason)
            self.emit(seq, tok, reason)

    def fail(self, seqs: list[Sequence], e: Exception) -> None:
        err = e
        if not isinstance(e, KvqError):
            err = KvqError(f"the engine failed on this request ({e!r}); other requests are unaffected. "
                           "This is a kvq bug, please report it.")
            err.__cause__ = e  # keep the original traceback for KVQ_DEBUG
        log.warning("request(s) %s failed: %r", [s.request_id for s in seqs], e)
        for seq in seqs:
            if seq.finished:
                continue
            seq.error = err
            self.scheduler.finish(seq, "error")
            self.emit(seq, None, "error")

    def finish_reason(self, seq: Sequence, tok: int) -> str | None:
        sp = seq.sampling
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok == self.cfg.eos_token_id):
            return "stop"
        out = seq.output_ids
        if any(len(out) >= len(s) and tuple(out[-len(s):]) == s for s in sp.stop_sequences):
            return "stop"
        if len(out) >= sp.max_tokens or seq.num_tokens >= self.max_seq_len:
            return "length"
        return None

    def emit(self, seq: Sequence, tok: int | None, reason: str | None) -> None:
        if reason is not None:
            seq.finish_reason = reason
            self.live.pop(seq.request_id, None)
            if seq.on_finish is not None:
                try:
                    seq.on_finish(seq.kv_cache_usage)
                except Exception:  # noqa: BLE001 - a broken callback never stops the loop
                    log.exception("on_finish callback failed")
        if seq.on_token is None:
            return
        try:
            if seq.sampling.logprobs:  # callers that ask for log-probs take them as a 4th argument
                seq.on_token(tok, reason is not None, reason, seq.logprobs[-1] if tok is not None else None)
            else:
                seq.on_token(tok, reason is not None, reason)
        except Exception:  # noqa: BLE001 - a broken callback cancels its own request, never the loop
            if reason is None:
                self.cancel(seq.request_id)
