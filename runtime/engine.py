"""The embedded engine: load a directory, serve many concurrent requests.

One background thread runs the step loop (schedule -> model step -> sample ->
callbacks) for every caller: `generate` (blocking, many prompts), `submit`
(callback per token; what the Triton python backend calls from its request
threads) and `stream` (async iterator). Requests submitted from different
threads land in the same batches; `stats` records every step's batch. A CPU
engine's torch work -- its load, every step, every scoring pass -- runs on the
process's one compute thread (runtime/compute_thread.py: one OpenMP pool).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import channel_keys, compute_thread, parallel, scoring, warmup
from .block_manager import BlockManager
from .config import ModelConfig
from .cuda_graphs import DecodeGraphs, can_capture
from .decode_burst import DEFAULT_BURST_STEPS, DecodeBurst
from .engine_dir import (
    load_tokenizer,
    read_settings,
    resolve_dtype,
    resolve_layer_formats,
    resolve_rotation,
    resolve_scales,
)
from .engine_ops import engine_backend
from .errors import InputError, KvqError, RequestError, UnsupportedError
from .kv_format import PER_CHANNEL_TOKENS, KVFormat
from .layer_formats import as_layer_formats, formats_name, uniform_format
from .model import LlamaModel
from .request_checks import check_request
from .rotation import KVRotation
from .runner import ModelRunner, PoolPlan, allocate_pool, gpu_pool_budget, plan_pool
from .sampling import SamplingParams
from .scheduler import KVCacheUsage, Scheduler, Sequence, TokenCallback
from .scoring import TokenScores
from .step_loop import EngineStats, StepLoop
from .weights import open_weights


@dataclass
class Generation:
    text: str | None
    token_ids: list[int]
    prompt_len: int
    finish_reason: str
    logprobs: list[float] | None = None  # per token of token_ids, when sampling.logprobs
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class Engine:
    def __init__(
        self, model: LlamaModel, fmt: KVFormat | tuple[KVFormat, ...], plan: PoolPlan, k_scales, v_scales, *, tokenizer=None,
        max_batch_size: int = 8, max_seq_len: int | None = None, max_tokens_per_step: int = 2048,
        attention: str = "auto", max_input_len: int | None = None, cuda_graphs: bool = True,
        batch_invariant: bool = False, prefix_caching: bool = True, burst_steps: int = 0, fused_ops: bool = False,
        warm_up: bool = True,
    ):
        self.model, self.cfg, self.tokenizer = model, model.cfg, tokenizer
        # one KVFormat per layer (runtime/layer_formats.py); a uniform engine repeats one
        self.formats = as_layer_formats(fmt, model.cfg.num_layers)
        self.max_seq_len = max_seq_len or model.cfg.max_position_embeddings
        self.max_input_len = max_input_len or self.max_seq_len
        # batch_invariant: a request's output independent of its batch mates (runtime/batch_invariant.py)
        self.batch_invariant = batch_invariant
        tensor_parallel = isinstance(model, parallel.TPLlamaModel)
        channel_keys.check_engine(self.formats, plan.block_size, model.device, tensor_parallel=tensor_parallel,
                                  batch_invariant=batch_invariant)
        self.backend = engine_backend(model, self.formats, attention, batch_invariant, fused_ops)
        caches = allocate_pool(model.cfg, self.formats, plan, model.device, k_scales, v_scales, model.num_kv_heads,
                               max_batch_size)
        # the page key's salt: K/V of another format, scales, model or dtype never match
        self.blocks = BlockManager(plan.num_blocks, plan.block_size, prefix_caching=prefix_caching,
                                   salt=_cache_salt(model, self.formats, k_scales, v_scales))
        channel_keys.release_on_free(self.blocks, caches)
        graphs = None
        if cuda_graphs and model.device.type == "cuda" and can_capture(self.backend):
            graphs = DecodeGraphs(model, caches, self.backend, max_batch_size, self.max_seq_len, plan.block_size)
        runner = parallel.TPModelRunner if tensor_parallel else ModelRunner
        self.runner = runner(model, caches, self.blocks, self.backend, graphs)
        if not isinstance(burst_steps, int) or burst_steps < 0:
            raise InputError(f"burst_steps must be an integer >= 0 (0 = one host round trip per step), "
                             f"got {burst_steps!r}.")
        if tensor_parallel and (burst_steps or fused_ops):
            raise UnsupportedError("burst_steps / fused_ops run on one device; a tensor-parallel engine steps once "
                                   "per host round trip with torch's small ops (burst_steps: 0, fused_ops: false).")
        # greedy decode steps in device-resident bursts of burst_steps (runtime/decode_burst.py)
        burst = None if not burst_steps else DecodeBurst(
            model, caches, self.backend, max_batch_size, self.max_seq_len, plan.block_size, burst_steps,
            use_graphs=cuda_graphs and can_capture(self.backend))
        self.scheduler = Scheduler(self.blocks, max_batch_size, max_tokens_per_step)
        self.stats = EngineStats(
            device=str(model.device), dtype=str(model.dtype).replace("torch.", ""), kv_format=formats_name(self.formats),
            attention=self.backend.name, weight_bytes=model.weight_bytes, pool_blocks=plan.num_blocks,
            block_size=plan.block_size, pool_tokens=plan.tokens, pool_bytes=plan.bytes,
            kv_bytes_per_token=plan.bytes_per_token, pool_source=plan.source,
            pool_allocated_bytes=sum(
                t.numel() * t.element_size() for c in caches
                for t in (c.k, c.v, c.k_scale, c.v_scale, c.k_zero, c.v_zero, c.k_residual)
                if t is not None and t.dim() >= 3
            ),
            cuda_graphs=graphs is not None, batch_invariant=batch_invariant, prefix_caching=prefix_caching,
            burst_steps=burst_steps, fused_ops=fused_ops, kv_rotation=model.rotation.name,
        )
        # compile, at load, the kernels the shapes of a step can need (runtime/warmup.py)
        if model.device.type == "cuda":
            warmup.count_compiles()
        if warm_up and warmup.applies(model, self.backend, self.formats, tensor_parallel=tensor_parallel,
                                      batch_invariant=batch_invariant):
            self.stats.warm_up_s = warmup.warm_up(
                model, caches, self.backend, max_batch=max_batch_size, max_seq_len=self.max_seq_len,
                max_tokens_per_step=max_tokens_per_step, pool_tokens=plan.tokens)
        self._compiles_at_load = warmup.compiles()
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._incoming: list[Sequence] = []
        self._cancels: set[int] = set()
        self._live: dict[int, Sequence] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._run_lock = threading.Lock()  # one model pass at a time: the step loop's or score's
        # where the passes run: a CPU engine's on the process's one compute thread (runtime/compute_thread.py)
        one_cpu = model.device.type == "cpu" and not tensor_parallel
        self._compute = compute_thread.run if one_cpu else compute_thread.direct
        self.steps = StepLoop(self.runner, self.scheduler, self.blocks, self.stats, self.cfg, self.max_seq_len,
                              self._live, self.cancel, burst)

    @property
    def fmt(self) -> KVFormat:
        """The KV format of every layer; a mixed engine has none (see `formats`)."""
        one = uniform_format(self.formats)
        if one is None:
            raise UnsupportedError(f"this engine stores a KV format per layer ({formats_name(self.formats)}); "
                                   "read engine.formats (one KVFormat per layer).")
        return one

    # ------------------------------------------------------------- loading
    @classmethod
    def from_dir(
        cls, path: str | Path, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
        kv_format: KVFormat | dict | str | None = None, kv_scales: str | Path | dict | None = None,
        max_batch_size: int | None = None, num_blocks: int | None = None, memory_budget: int | None = None,
        attention: str = "auto", block_size: int | None = None, max_seq_len: int | None = None,
        max_tokens_per_step: int | None = None, cuda_graphs: bool | None = None,
        batch_invariant: bool | None = None, prefix_caching: bool | None = None, tp: int | None = None,
        tp_invariant: bool | None = None, burst_steps: int | None = None, fused_ops: bool | None = None,
        kv_rotation: KVRotation | str | None = None, seq_tokens: int | None = None,
    ) -> Engine:
        """tp > 1: this process is rank 0 of a tensor-parallel engine and starts the other ranks
        (or, under torchrun, every rank calls this; ranks other than 0 serve until rank 0 shuts
        down, then return their stopped engine). tp_invariant: the same bits for every tp
        (docs/tensor_parallel.md). runtime/parallel/ has the details.
        kv_rotation: None reads the engine's own (kv_format.json "rotation"); 'none' / 'hadamard' /
        a KVRotation override it (the weights are folded at load time, so any rotation is exact).
        seq_tokens: the tokens a request is sized for; per-channel keys then keep fp16 residual blocks only for the
        requests of that length the pool holds (runner.plan_pool), and run at most that many at once."""
        rank_args = {k: v for k, v in locals().items() if k not in ("cls", "path")}  # every rank's from_dir
        d = Path(path)
        if not d.is_dir():
            raise InputError(f"{d} is not a directory; point to an engine or converted model directory.")
        if attention not in ("auto", "reference", "triton"):
            raise InputError(f"attention must be 'auto', 'reference' or 'triton', got {attention!r}.")
        cfg = ModelConfig.from_dir(d)
        settings = read_settings(d)
        dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = resolve_dtype(dtype, dev, d)
        fmt = resolve_layer_formats(kv_format, d, torch_dtype, cfg.num_layers)
        k_scales, v_scales = resolve_scales(fmt, kv_scales, d, cfg)
        rotation = resolve_rotation(kv_rotation, d, cfg)
        tp = _pick(tp, settings.tp)
        if tp > 1:
            if rotation.active:
                raise UnsupportedError("kv_rotation: a tensor-parallel engine loads its weight shards unfolded; "
                                       "use kv.rotation: none with build.tp > 1.")
            model = parallel.load_rank(cfg, d, dev, torch_dtype, tp, rank_args, cls.from_dir)
            k_scales, v_scales = (parallel.slice_kv_scales(s, model.shard) for s in (k_scales, v_scales))
            try:
                return cls._from_model(model, d, settings, fmt, k_scales, v_scales, **{**rank_args, "tp": tp})
            except BaseException:
                model.group.close(abort=True)
                raise

        def load() -> Engine:
            model = LlamaModel(cfg, open_weights(d, cfg), dev, torch_dtype, rotation=rotation)
            return cls._from_model(model, d, settings, fmt, k_scales, v_scales, **{**rank_args, "tp": tp})

        # a CPU engine loads where it will step (runtime/compute_thread.py): one OpenMP pool in the process
        return compute_thread.run(load) if dev.type == "cpu" else load()

    @classmethod
    def _from_model(cls, model: LlamaModel, d: Path, settings, fmt: tuple[KVFormat, ...], k_scales, v_scales, *,
                    max_batch_size, num_blocks, memory_budget, attention, block_size, max_seq_len,
                    max_tokens_per_step, cuda_graphs, batch_invariant, prefix_caching, tp, tp_invariant, burst_steps,
                    fused_ops, seq_tokens=None, **_) -> Engine:
        cfg, dev = model.cfg, model.device
        model.exact_row_sums = _pick(tp_invariant, settings.tp_invariant)
        batch = max_batch_size or settings.max_batch_size or (8 if dev.type == "cpu" else 64)
        seq_len = min(max_seq_len or settings.max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        step_tokens = max_tokens_per_step or max(2048, settings.max_input_len or 0)
        # per-channel keys scale over one block of their PER_CHANNEL_TOKENS positions
        bsz = block_size or (PER_CHANNEL_TOKENS if any(f.per_channel_keys for f in fmt) else settings.block_size)
        gpu_budget = None
        if dev.type == "cuda" and num_blocks is None and memory_budget is None:
            gpu_budget = gpu_pool_budget(model, step_tokens, settings.gpu_memory_fraction)
            if tp > 1:  # every rank's pool holds the same blocks: the smallest budget
                gpu_budget = model.group.min_int(gpu_budget)
        plan = plan_pool(cfg, fmt, bsz, num_blocks=num_blocks, memory_budget=memory_budget,
                         gpu_free_budget=gpu_budget, default_tokens=batch * seq_len, tp=tp, max_num_seqs=batch,
                         seq_tokens=seq_tokens)
        if any(f.per_channel_keys for f in fmt):  # one residual slot per running sequence: admit no more
            batch = min(batch, plan.residual_slots)
        invariant = _pick(batch_invariant, settings.batch_invariant, dev.type == "cpu")
        one_gpu = dev.type == "cuda" and tp == 1  # bursts and the fused ops run on one device (docs/decode_step.md)
        engine = cls(model, fmt, plan, k_scales, v_scales, tokenizer=load_tokenizer(d), max_batch_size=batch,
                   max_seq_len=seq_len, max_tokens_per_step=step_tokens, attention=attention,
                   max_input_len=settings.max_input_len,
                   cuda_graphs=settings.cuda_graphs if cuda_graphs is None else cuda_graphs,
                   batch_invariant=invariant, prefix_caching=_pick(prefix_caching, settings.prefix_caching),
                   burst_steps=_pick(burst_steps, settings.burst_steps, DEFAULT_BURST_STEPS if one_gpu else 0),
                   fused_ops=_pick(fused_ops, settings.fused_ops, one_gpu and not invariant))
        if isinstance(engine.runner, parallel.TPModelRunner) and not model.group.is_driver:
            engine.runner.serve()  # until rank 0 shuts down
            engine.shutdown()
        return engine

    # ----------------------------------------------------------- requests
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
        seqs = [Sequence(next(self._ids), check_request(ids, sp, self.cfg.vocab_size, self.max_input_len,
                                                      self.max_seq_len, self.blocks), sp, cb, on_finish) for ids, cb in requests]
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
        self.runner.close()
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
                self.exclusive(self._step)
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving new ones
                err = e
                if not isinstance(e, KvqError):
                    err = KvqError(f"engine step failed: {e!r}; this is a kvq bug, please report it.")
                    err.__cause__ = e  # keep the original traceback for KVQ_DEBUG
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    seq.error = err
                    self.scheduler.finish(seq, "error")
                    self._emit(seq, None, "error")

    def exclusive(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) as one pass over this engine's model and pool: between two steps of the step loop, on the
        thread where the steps run (a CPU engine's compute thread). Scoring and benchmarks that drive the pool
        themselves call this."""
        return self._compute(self._locked, fn, *args)

    def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._run_lock:
            return fn(*args)

    def _step(self) -> None:
        self.steps.step()
        self.stats.serving_compiles = warmup.compiles() - self._compiles_at_load

    def _fail(self, seqs: list[Sequence], e: Exception) -> None:
        self.steps.fail(seqs, e)

    def _emit(self, seq: Sequence, tok: int | None, reason: str | None) -> None:
        self.steps.emit(seq, tok, reason)

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
        return scoring.score(self, sequences, start, tokens_per_pass, on_pass, self.exclusive)

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


def _cache_salt(model: LlamaModel, formats, k_scales, v_scales) -> str:
    """What a page's K/V depend on besides its tokens: the model, its dtype, the layers' KV formats,
    the static scales and the KV rotation (a page key includes this, so their pages never match)."""
    scales = [[None if t is None else torch.as_tensor(t).flatten().tolist() for t in s]
              for s in (k_scales, v_scales) if s is not None]
    return repr((model.cfg, str(model.dtype), model.weight_bytes, [f.name for f in formats], scales,
                 model.rotation.name))


def _pick(*choices):
    """The first choice that is not None."""
    return next(c for c in choices if c is not None)
