"""The embedded engine: load a directory, serve many concurrent requests.

One background thread runs the step loop (schedule -> model step -> sample ->
callbacks) for every caller: `generate` (blocking, many prompts), `submit`
(callback per token; what the Triton python backend calls from its request
threads) and `stream` (async iterator). Requests submitted from different
threads land in the same batches; `stats` records every step's batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import batch_invariant, scoring
from .attention import select_backend
from .block_manager import BlockManager
from .config import ModelConfig
from .cuda_graphs import DecodeGraphs, can_capture
from .engine_dir import (
    load_tokenizer,
    read_settings,
    resolve_dtype,
    resolve_kv_format,
    resolve_rotation,
    resolve_scales,
)
from .errors import InputError, KvqError, RequestError
from .kv_format import KVFormat
from .model import LlamaModel
from .rotation import KVRotation
from .runner import ModelRunner, PoolPlan, allocate_pool, plan_pool
from .sampling import SamplingParams, select_tokens
from .scheduler import KVCacheUsage, Scheduler, Sequence, TokenCallback
from .scoring import TokenScores
from .weights import open_weights


@dataclass
class Generation:
    text: str | None
    token_ids: list[int]
    prompt_len: int
    finish_reason: str
    logprobs: list[float] | None = None  # per token of token_ids, when sampling.logprobs
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


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

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Engine:
    def __init__(
        self, model: LlamaModel, fmt: KVFormat, plan: PoolPlan, k_scales, v_scales, *, tokenizer=None,
        max_batch_size: int = 8, max_seq_len: int | None = None, max_tokens_per_step: int = 2048,
        attention: str = "auto", max_input_len: int | None = None, cuda_graphs: bool = True,
        batch_invariant: bool = False, prefix_caching: bool = True,
    ):
        self.model, self.cfg, self.fmt, self.tokenizer = model, model.cfg, fmt, tokenizer
        self.max_seq_len = max_seq_len or model.cfg.max_position_embeddings
        self.max_input_len = max_input_len or self.max_seq_len
        # batch_invariant: a request's output independent of its batch mates (runtime/batch_invariant.py)
        self.batch_invariant = batch_invariant
        self.backend = select_backend(model.device, fmt, attention)  # also checks `attention` for the device
        if batch_invariant:
            if attention == "triton":
                raise InputError("the batch-invariant mode runs its own attention ops; pass attention='auto' "
                                 "or batch_invariant=False to use the Triton kernels.")
            self.backend = batch_invariant_backend(model)
        caches = allocate_pool(model.cfg, fmt, plan, model.device, k_scales, v_scales)
        # the page key's salt: K/V of another format, scales, model or dtype never match
        self.blocks = BlockManager(plan.num_blocks, plan.block_size, prefix_caching=prefix_caching,
                                   salt=_cache_salt(model, fmt, k_scales, v_scales))
        graphs = None
        if cuda_graphs and model.device.type == "cuda" and can_capture(self.backend):
            graphs = DecodeGraphs(model, caches, self.backend, max_batch_size, self.max_seq_len, plan.block_size)
        self.runner = ModelRunner(model, caches, self.blocks, self.backend, graphs)
        self.scheduler = Scheduler(self.blocks, max_batch_size, max_tokens_per_step)
        self.stats = EngineStats(
            device=str(model.device), dtype=str(model.dtype).replace("torch.", ""), kv_format=fmt.name,
            attention=self.backend.name, weight_bytes=model.weight_bytes, pool_blocks=plan.num_blocks,
            block_size=plan.block_size, pool_tokens=plan.tokens, pool_bytes=plan.bytes,
            kv_bytes_per_token=plan.bytes_per_token, pool_source=plan.source,
            pool_allocated_bytes=sum(
                t.numel() * t.element_size() for c in caches
                for t in (c.k, c.v, c.k_scale, c.v_scale, c.k_zero, c.v_zero) if t is not None and t.dim() >= 3
            ),
            cuda_graphs=graphs is not None, batch_invariant=batch_invariant, prefix_caching=prefix_caching,
            kv_rotation=model.rotation.name,
        )
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._incoming: list[Sequence] = []
        self._cancels: set[int] = set()
        self._live: dict[int, Sequence] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._run_lock = threading.Lock()  # one model pass at a time: the step loop's or score's

    # ------------------------------------------------------------- loading
    @classmethod
    def from_dir(
        cls, path: str | Path, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
        kv_format: KVFormat | dict | str | None = None, kv_scales: str | Path | dict | None = None,
        max_batch_size: int | None = None, num_blocks: int | None = None, memory_budget: int | None = None,
        attention: str = "auto", block_size: int | None = None, max_seq_len: int | None = None,
        max_tokens_per_step: int | None = None, cuda_graphs: bool | None = None,
        batch_invariant: bool | None = None, prefix_caching: bool | None = None,
        kv_rotation: KVRotation | str | None = None,
    ) -> Engine:
        """kv_rotation: None reads the engine's own (kv_format.json "rotation"); 'none' / 'hadamard' /
        a KVRotation override it (the weights are folded at load time, so any rotation is exact)."""
        d = Path(path)
        if not d.is_dir():
            raise InputError(f"{d} is not a directory; point to an engine or converted model directory.")
        if attention not in ("auto", "reference", "triton"):
            raise InputError(f"attention must be 'auto', 'reference' or 'triton', got {attention!r}.")
        cfg = ModelConfig.from_dir(d)
        settings = read_settings(d)
        dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = resolve_dtype(dtype, dev, d)
        fmt = resolve_kv_format(kv_format, d, torch_dtype)
        k_scales, v_scales = resolve_scales(fmt, kv_scales, d, cfg)
        rotation = resolve_rotation(kv_rotation, d, cfg)
        model = LlamaModel(cfg, open_weights(d, cfg), dev, torch_dtype, rotation=rotation)
        batch = max_batch_size or settings.max_batch_size or (8 if dev.type == "cpu" else 64)
        seq_len = min(max_seq_len or settings.max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        step_tokens = max_tokens_per_step or max(2048, settings.max_input_len or 0)
        bsz = block_size or settings.block_size
        gpu_budget = None
        if dev.type == "cuda" and num_blocks is None and memory_budget is None:
            gpu_budget = _gpu_pool_budget(model, step_tokens, settings.gpu_memory_fraction)
        plan = plan_pool(cfg, fmt, bsz, num_blocks=num_blocks, memory_budget=memory_budget,
                         gpu_free_budget=gpu_budget, default_tokens=batch * seq_len)
        return cls(model, fmt, plan, k_scales, v_scales, tokenizer=load_tokenizer(d), max_batch_size=batch,
                   max_seq_len=seq_len, max_tokens_per_step=step_tokens, attention=attention,
                   max_input_len=settings.max_input_len,
                   cuda_graphs=settings.cuda_graphs if cuda_graphs is None else cuda_graphs,
                   batch_invariant=_pick(batch_invariant, settings.batch_invariant, dev.type == "cpu"),
                   prefix_caching=_pick(prefix_caching, settings.prefix_caching))

    # ----------------------------------------------------------- requests
    def _validate(self, prompt_ids: list[int], sp: SamplingParams) -> list[int]:
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise RequestError("the prompt is empty; send at least one token.")
        vocab = self.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab}); check the tokenizer.")
        for name, seqs in (("stop_token_ids", [sp.stop_token_ids]), ("bad_words", sp.bad_words),
                           ("stop_sequences", sp.stop_sequences)):
            bad = [t for s in seqs for t in s if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{name} holds token id(s) {bad[:4]} outside [0, {vocab}); fix the request field.")
        if len(ids) > self.max_input_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, the engine accepts at most {self.max_input_len} "
                "(max_input_len in engine.json); shorten it or rebuild the engine with a larger max_input_len."
            )
        total = len(ids) + sp.max_tokens
        if total > self.max_seq_len:
            raise RequestError(
                f"max_tokens must be in [1, {self.max_seq_len - len(ids)}] for a {len(ids)}-token prompt: "
                f"prompt + max_tokens ({sp.max_tokens}) = {total} exceeds max_seq_len {self.max_seq_len}; "
                "shorten the prompt or lower max_tokens."
            )
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise RequestError(
                f"a request of {total} tokens needs {self.blocks.blocks_for(total)} KV blocks but the pool has "
                f"{self.blocks.num_blocks}; lower max_tokens or give the engine more KV memory."
            )
        return ids

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("this engine has no tokenizer (synthetic weights?); pass token ids instead of text.")
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    def submit(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
               on_token: TokenCallback | None = None, *,
               on_finish: Callable[[KVCacheUsage], None] | None = None) -> int:
        """Queue a request for the background step loop; returns its id. `on_finish` gets the
        request's KV page usage just before its final `on_token` call."""
        return self._submit([(prompt_ids, on_token)], sampling, on_finish)[0].request_id

    def _submit(self, requests: list[tuple[list[int], TokenCallback | None]],
                sampling: SamplingParams | None, on_finish: Callable | None = None) -> list[Sequence]:
        """Validate all, then enqueue all at once (so one call's prompts share the first step)."""
        sp = sampling or SamplingParams()
        seqs = [Sequence(next(self._ids), self._validate(ids, sp), sp, cb, on_finish) for ids, cb in requests]
        for seq in seqs:
            seq.generator = None if sp.greedy else sp.make_generator()
        with self._cv:
            if self._stopped:
                raise RequestError("the engine is shut down; create a new one.")
            self._incoming.extend(seqs)
            self._live.update((seq.request_id, seq) for seq in seqs)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvq-engine", daemon=True)
                self._thread.start()
            self._cv.notify()
        return seqs

    def cancel(self, request_id: int) -> None:
        with self._cv:
            self._cancels.add(request_id)
            self._cv.notify()

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for seq in list(self._live.values()):
            self._emit(seq, None, "cancelled")
        self._live.clear()

    # ---------------------------------------------------------- step loop
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug in the loop itself: fail every caller instead of hanging them
            with self._cv:
                self._stopped = True
            err = KvqError(f"the engine's step loop died: {e!r}; create a new engine.")
            err.__cause__ = e
            for seq in list(self._live.values()) + self._incoming:
                seq.error = err
                self._emit(seq, None, "error")
            logging.getLogger("kvq.engine").exception("engine step loop died")

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._incoming or self._cancels or self.scheduler.has_work()):
                    self._cv.wait()
                if self._stopped:
                    return
                incoming, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, set()
            for seq in incoming:
                self.scheduler.add(seq)
            for rid in cancels:
                seq = self._live.get(rid)
                if seq is not None:
                    self.scheduler.finish(seq, "cancelled")
                    self._emit(seq, None, "cancelled")
            try:
                with self._run_lock:
                    self._step()
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving new ones
                err = e
                if not isinstance(e, KvqError):
                    err = KvqError(f"engine step failed: {e!r}; this is a kvq bug, please report it.")
                    err.__cause__ = e  # keep the original traceback for KVQ_DEBUG
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    seq.error = err
                    self.scheduler.finish(seq, "error")
                    self._emit(seq, None, "error")

    def _step(self) -> None:
        step = self.scheduler.schedule()
        if not step:
            return
        try:
            logits = self.runner.run(step)
        except Exception as e:  # noqa: BLE001 - the forward is shared: fail this step's requests only
            self._fail(list(step.decode) + list(step.prefill), e)
            return
        self.scheduler.commit(step)  # K/V written: the step's full pages become reusable
        seqs = step.sampled  # a prefill chunk that is not its prompt's last gets no token
        eos = () if self.cfg.eos_token_id is None else (self.cfg.eos_token_id,)
        picks = select_tokens(logits, seqs, eos)
        st = self.stats
        st.step_batch_sizes.append(len(step.decode) + len(step.prefill))
        st.step_num_tokens.append(step.num_tokens)
        st.preemptions = self.scheduler.num_preemptions
        st.prompt_tokens += sum(len(s.prompt_ids) for s in step.completed_prefill if not s.preemptions)
        st.generated_tokens += len(seqs)
        cs = self.blocks.cache_stats
        st.prefix_lookups, st.prefix_hits, st.prefix_hit_rate = cs.lookups, cs.hits, cs.hit_rate
        st.reused_tokens, st.evictions = cs.reused_tokens, cs.evictions
        for seq, pick in zip(seqs, picks):
            # Whatever goes wrong with one request (its logits, sampling, stop checks) ends that request
            # alone: its blocks are freed and every other sequence keeps its step.
            try:
                if pick.error is not None:
                    raise pick.error
                seq.output_ids.append(pick.token)
                if seq.sampling.logprobs:
                    seq.logprobs.append(pick.logprob)
                reason = self._finish_reason(seq, pick.token)
            except Exception as e:  # noqa: BLE001
                self._fail([seq], e)
                continue
            if reason is not None:
                self.scheduler.finish(seq, reason)
            self._emit(seq, pick.token, reason)

    def _fail(self, seqs: list[Sequence], e: Exception) -> None:
        err = e
        if not isinstance(e, KvqError):
            err = KvqError(f"the engine failed on this request ({e!r}); other requests are unaffected. "
                           "This is a kvq bug, please report it.")
            err.__cause__ = e  # keep the original traceback for KVQ_DEBUG
        logging.getLogger("kvq.engine").warning("request(s) %s failed: %r", [s.request_id for s in seqs], e)
        for seq in seqs:
            if seq.finished:
                continue
            seq.error = err
            self.scheduler.finish(seq, "error")
            self._emit(seq, None, "error")

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        sp = seq.sampling
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok == self.cfg.eos_token_id):
            return "stop"
        out = seq.output_ids
        if any(len(out) >= len(s) and tuple(out[-len(s):]) == s for s in sp.stop_sequences):
            return "stop"
        if len(out) >= sp.max_tokens or seq.num_tokens >= self.max_seq_len:
            return "length"
        return None

    def _emit(self, seq: Sequence, tok: int | None, reason: str | None) -> None:
        if reason is not None:
            seq.finish_reason = reason
            self._live.pop(seq.request_id, None)
            if seq.on_finish is not None:
                try:
                    seq.on_finish(seq.kv_cache_usage)
                except Exception:  # noqa: BLE001 - a broken callback never stops the loop
                    logging.getLogger("kvq.engine").exception("on_finish callback failed")
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

    # ------------------------------------------------------------ callers
    def generate(self, prompts: list[str] | list[list[int]], sampling: SamplingParams | None = None,
                 **sampling_kw: Any) -> list[Generation]:
        """Blocking: all prompts batched together; results in prompt order."""
        if sampling is not None and sampling_kw:
            raise RequestError("pass either a SamplingParams or keyword sampling fields, not both.")
        sp = sampling or SamplingParams(**sampling_kw)
        if isinstance(prompts, str):
            prompts = [prompts]
        encoded = [self.encode(p) for p in prompts]
        done = [threading.Event() for _ in encoded]
        seqs = self._submit([(ids, lambda tok, fin, *_, ev=ev: fin and ev.set()) for ids, ev in zip(encoded, done)], sp)
        for ev in done:
            ev.wait()
        out = []
        for seq in seqs:
            if seq.finish_reason == "error":
                raise seq.error or KvqError("generation failed in the engine step loop.")
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True) if self.tokenizer else None
            out.append(Generation(text, list(seq.output_ids), len(seq.prompt_ids), seq.finish_reason,
                                  list(seq.logprobs) if sp.logprobs else None, seq.cached_tokens))
        return out

    def score(self, sequences: list[list[int]], start: int | list[int] = 1, tokens_per_pass: int | None = None,
              on_pass: Callable[[int], None] | None = None) -> list[TokenScores]:
        """Teacher-forced log p(ids[t] | ids[:t]) and the argmax at every t >= start of each sequence,
        computed by prefill passes through this engine's pool, kernels and chunking (runtime/scoring.py)."""
        return scoring.score(self, sequences, start, tokens_per_pass, on_pass, self._run_lock)

    async def stream(self, prompt: list[int] | str, sampling: SamplingParams | None = None,
                     **sampling_kw: Any) -> AsyncIterator[int]:
        """Yield token ids as they are generated; leaving the loop early cancels the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sp = sampling or SamplingParams(**sampling_kw)
        (seq,) = self._submit([(self.encode(prompt), lambda *ev: loop.call_soon_threadsafe(queue.put_nowait, ev))], sp)
        finished = False
        try:
            while not finished:
                tok, finished, reason, *_ = await queue.get()
                if reason == "error":
                    raise seq.error or KvqError("generation failed in the engine step loop.")
                if tok is not None:
                    yield tok
        finally:
            if not finished:
                self.cancel(seq.request_id)


def _cache_salt(model: LlamaModel, fmt: KVFormat, k_scales, v_scales) -> str:
    """What a page's K/V depend on besides its tokens: the model, its dtype, the KV format, the
    static scales and the KV rotation (a page key includes this, so their pages never match)."""
    scales = [s.flatten().tolist() for s in (k_scales, v_scales) if s is not None]
    return repr((model.cfg, str(model.dtype), model.weight_bytes, fmt.name, scales, model.rotation.name))


def _pick(*choices):
    """The first choice that is not None."""
    return next(c for c in choices if c is not None)


def batch_invariant_backend(model: LlamaModel):
    """The mode's ops, after measuring that this machine's GEMMs allow it (UnsupportedError if not)."""
    layer = model.layer(0)
    rotation = [model.rotation_weight] if model.rotation_weight is not None else []
    batch_invariant.check([layer.qkv, layer.o, layer.gate_up, layer.down, model.lm_head, *rotation],
                          model.cfg.head_dim)
    return batch_invariant.backend()


def _gpu_pool_budget(model: LlamaModel, step_tokens: int, fraction: float) -> int:
    """Bytes for the KV pool: `fraction` of the free GPU memory after the weights,
    minus the activation peak of a warm-up forward over a full step of tokens."""
    dev = model.device
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    ids = torch.zeros(min(step_tokens, model.cfg.max_position_embeddings), dtype=torch.int64, device=dev)
    model.forward_dense(ids)
    torch.cuda.synchronize(dev)
    activations = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(dev)
    return int(fraction * free - activations)
