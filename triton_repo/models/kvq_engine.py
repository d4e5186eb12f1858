"""Triton python model `kvq_engine`: our embedded engine behind a decoupled model.

Copied into <repo>/kvq_engine/1/model.py. One engine per model instance, in a
process of its own (triton_repo/engine_worker.py) started in initialize() and
stopped in finalize(): the response sends of this stub hold its GIL for each
token of each stream, and the engine's step loop must not wait on them
(docs/serving.md). execute() only validates and submits; the engine's own loop
batches every in-flight request continuously (Triton's batching would only
group requests that arrive together) and sends each step's token events in one
message. A reader thread records them; one sender thread sends the responses:
when streaming, a response carries every token its client has not seen (one
per token while the sender keeps up; cumulative ids + how many were already
shown, so postprocessing detokenizes exactly), one final response otherwise.
If the engine process dies, every request in flight gets an error, and so does
every later one (the model is then useless until it is reloaded).
A client that goes away (request cancelled, or the sender refuses) cancels its
engine request, so its blocks are freed and the batch goes on without it.
(tritonserver 2.51 does not pass an ensemble request's cancellation on to its
composing models: behind the ensemble an orphaned request runs to max_tokens.)
Inputs and outputs carry tensorrt_llm's names and shapes ([batch, beam, ...]);
fields with no meaning on this engine are refused by name unless empty/default.
"""

import itertools
import json
import math
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.errors import KvqError, RequestError
from runtime.sampling import SamplingParams
from triton_repo import protocol
from triton_repo.engine_metrics import EngineMetrics
from triton_repo.engine_process import EngineProcess

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ENGINE_FIELDS = {f.to: f for f in protocol.ENSEMBLE_REQUEST + protocol.BLS_EXTRA if f.step == "engine"}
FIELD_OF = {to: f.name for to, f in ENGINE_FIELDS.items()}  # engine input -> request field
CANCEL_POLL_S = 0.1
FAILED = "the engine failed on this request (requests beside it are unaffected); see the server log."


def _array(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _scalar(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy().reshape(-1)
    if a.size != 1:
        raise RequestError(f"{FIELD_OF.get(name, name)} must hold exactly one value, got {a.size}.")
    return a[0].item()


def _error(e, code=None):
    if code is None:
        code = pb_utils.TritonError.INVALID_ARG if isinstance(e, RequestError) else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), code))


class _Request:
    """One client request: its sender, what it has generated, and whether it is closed."""

    def __init__(self, model, key, sender, stream, prefix, logprobs, perf_metrics=False):
        self.model, self.key, self.sender = model, key, sender
        self.stream = stream
        self.prefix = prefix  # prompt ids a non-streamed response starts with (exclude_input_in_output false)
        self.want_logprobs = logprobs
        self.want_perf_metrics = perf_metrics
        self.kv_usage = None  # (reused, new) KV blocks, with the final token
        self.ids = []
        self.logprobs = []
        self.shown = 0
        self.done = False
        self.lock = threading.Lock()
        self.finished = False  # the engine's last token (or its failure) arrived
        self.failed = None  # the engine failed on this request: the error response to send
        self.cancelled = False  # the client went away
        self.queued = False  # waiting in the model's outbox for the sender thread

    def _response(self, final):
        """tensorrt_llm's response tensors ([batch, beam, ...] with max_batch_size, else [beam, ...])."""
        lead = (1,) if self.model.max_batch else ()
        ids = self.ids if self.stream else self.prefix + self.ids
        shown = self.shown if self.stream else 0
        n = len(ids)

        def tensor(name, values, dtype, shape):
            return pb_utils.Tensor(name, np.array(values, dtype=dtype).reshape(lead + shape))

        tensors = [
            tensor("output_ids", ids, np.int32, (1, n)),
            tensor("sequence_length", [n], np.int32, (1,)),
            tensor("prev_length", [shown], np.int32, (1,)),
            tensor("is_final", [final], bool, (1,)),
            tensor("batch_index", [0], np.int32, (1,)),
            tensor("sequence_index", [0], np.int32, (1,)),
        ]
        if self.want_logprobs:
            # Streamed responses carry the new tokens' log-probs, the last one all of them (as tensorrt_llm).
            new = self.logprobs[self.shown :] if self.stream else self.logprobs
            tensors += [
                tensor("cum_log_probs", [sum(self.logprobs)], np.float32, (1,)),
                tensor("output_log_probs", new, np.float32, (1, len(new))),
            ]
        if self.want_perf_metrics and final and self.kv_usage is not None:
            reused, new = self.kv_usage  # as tensorrt_llm: on the final response, counted in KV pages
            tensors += [
                tensor("kv_cache_alloc_new_blocks", [new], np.int32, (1,)),
                tensor("kv_cache_reused_blocks", [reused], np.int32, (1,)),
                tensor("kv_cache_alloc_total_blocks", [reused + new], np.int32, (1,)),
            ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def on_token(self, token_id, finished, finish_reason, logprob=None, usage=None, failure=None):
        """Called from the reader thread, per event of the engine's step: record the token and hand the
        request to the sender thread. A sender that lags behind the engine sends every token it has not
        shown yet in one response. `failure` is the error response when the engine refused or lost it."""
        with self.lock:
            if self.done or self.finished:
                return
            if token_id is not None:
                self.ids.append(int(token_id))
                if self.want_logprobs:
                    self.logprobs.append(float(logprob))
            self.finished = finished
            self.kv_usage = usage
            if finish_reason == "error" and token_id is None:
                self.failed = failure or pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(FAILED, pb_utils.TritonError.INTERNAL)
                )
            if not (finished or self.stream) or self.queued:
                return
            self.queued = True
        self.model.outbox.put(self)

    def close_cancelled(self):
        """The client went away (watcher thread): the sender closes its stream."""
        with self.lock:
            if self.done or self.cancelled:
                return
            self.cancelled = True
            if self.queued:
                return
            self.queued = True
        self.model.outbox.put(self)

    def flush(self):
        """Sender thread: one response with what the request has that its client has not seen. The send
        holds the request's lock, as the watcher's is_cancelled does: tritonserver 2.51 segfaults when
        IsCancelled meets a response factory that a final response has just freed."""
        with self.lock:
            self.queued = False
            if self.done:
                return
            final = self.finished or self.failed is not None or self.cancelled
            try:
                if self.failed is not None:
                    self.sender.send(self.failed, flags=FINAL)
                elif self.cancelled or (self.stream and len(self.ids) == self.shown):
                    if final:  # the client is gone, or every token was already streamed
                        self.sender.send(flags=FINAL)
                else:
                    self.sender.send(self._response(final=self.finished), flags=FINAL if self.finished else 0)
                    self.shown = len(self.ids)
            except Exception:  # the client is gone (or a close was best effort): stop generating for it
                final = True
            self.done = final
            finished = self.finished
        if final:
            # After a vanished client the engine would go on: cancel it there.
            self.model.forget(self, cancel_engine=not finished)


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        engine_dir = params["engine_dir"]
        self.max_batch = cfg.get("max_batch_size", 0) > 0
        self.limits = protocol.EngineLimits.from_engine_dir(engine_dir)
        self.exclude_input = params.get("exclude_input_in_output", "true") == "true"
        self.active = {}  # request key -> _Request still streaming
        self.active_lock = threading.Lock()  # lock order: _Request.lock, then active_lock
        self.keys = itertools.count()
        self.lost = None  # why the engine process is gone, once it is
        self.to_cancel = queue.SimpleQueue()
        self.new_steps = queue.SimpleQueue()  # step batch sizes from the engine, for the metrics
        self.stopping = threading.Event()
        self.metrics = EngineMetrics(args.get("model_instance_name", "kvq_engine"))
        self.outbox = queue.SimpleQueue()  # requests with something to send (_Request.flush)
        self.engine = EngineProcess(engine_dir, params.get("device", "auto"), self._on_events, self._on_lost)
        self.vocab_size = self.engine.info["vocab_size"]
        self.metrics.engine_up(True)
        pb_utils.Logger.log_info(f"kvq_engine: engine process pid {self.engine.pid} serves {engine_dir}")
        self.sender = threading.Thread(target=self._send_loop, name="kvq-send", daemon=True)
        self.sender.start()
        self.watcher = threading.Thread(target=self._watch, name="kvq-cancel-watch", daemon=True)
        self.watcher.start()

    # ------------------------------------------------------ engine process
    def _on_events(self, events, step_sizes):
        """Reader thread: one message of the engine process, the token events of one or more steps."""
        if step_sizes:
            self.new_steps.put(step_sizes)
        active = self.active
        for key, token, finished, reason, logprob, usage, refused in events:
            req = active.get(key)
            if req is None:  # its client is gone and the request is forgotten
                continue
            failure = None
            if refused is not None:  # the engine refused it at submit (e.g. more KV blocks than the pool)
                is_request_error, message = refused
                failure = _error(RequestError(message) if is_request_error else KvqError(message))
            req.on_token(token, finished, reason, logprob, usage, failure)

    def _on_lost(self, why):
        """Reader thread: the engine process ended on its own. Fail every request; refuse new ones."""
        self.lost = (
            f"{why}; this kvq_engine instance cannot serve until the model is reloaded "
            "(or the server restarted). The server log has the engine's last words."
        )
        pb_utils.Logger.log_error(f"kvq_engine: {self.lost}")
        self.metrics.engine_up(False)
        failure = _error(self.lost, pb_utils.TritonError.UNAVAILABLE)
        with self.active_lock:
            reqs = list(self.active.values())
        for req in reqs:
            req.on_token(None, True, "error", failure=failure)

    # --------------------------------------------------------------- requests
    def _parse(self, request):
        for name, f in ENGINE_FIELDS.items():
            t = pb_utils.get_input_tensor_by_name(request, name) if f.inert else None
            if t is not None and not protocol.is_default(t.as_numpy()):
                raise protocol.refuse_inert(f)
        ids = (
            pb_utils.get_input_tensor_by_name(request, "input_ids")
            .as_numpy()
            .reshape(-1)
            .astype(np.int64)
            .tolist()
        )
        max_tokens = int(_scalar(request, "request_output_len", 0))
        self.limits.check(len(ids), max_tokens)
        for name in ("beam_width", "num_return_sequences"):
            value = int(_scalar(request, name, 1))
            if value != 1:
                raise RequestError(f"{name} must be 1 (kvq engines decode one sequence per request), got {value}.")
        length_penalty = float(_scalar(request, "len_penalty", 1.0))
        if not math.isfinite(length_penalty):
            raise RequestError(
                f"length_penalty must be a finite number (no effect at beam_width 1), got {length_penalty}."
            )
        end_id = _scalar(request, "end_id", None)
        vocab = self.vocab_size
        if end_id is not None and not 0 <= int(end_id) < vocab:
            raise RequestError(f"end_id must be a token id in [0, {vocab}), got {end_id}.")
        seed = _scalar(request, "random_seed", None)
        logprobs = bool(_scalar(request, "return_log_probs", False))
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=float(_scalar(request, "temperature", 0.0)),
                top_k=int(_scalar(request, "runtime_top_k", 0)),
                top_p=float(_scalar(request, "runtime_top_p", 1.0)),
                seed=None if seed is None else int(seed),
                # end_id replaces the model's EOS as the end token, as in tensorrt_llm
                stop_token_ids=() if end_id is None else (int(end_id),),
                ignore_eos=end_id is not None,
                repetition_penalty=float(_scalar(request, "repetition_penalty", 1.0)),
                presence_penalty=float(_scalar(request, "presence_penalty", 0.0)),
                frequency_penalty=float(_scalar(request, "frequency_penalty", 0.0)),
                min_tokens=int(_scalar(request, "min_length", 0)),
                bad_words=protocol.stop_sequences(_array(request, "bad_words_list")),
                stop_sequences=protocol.stop_sequences(_array(request, "stop_words_list")),
                logprobs=logprobs,
            )
        except RequestError as e:  # name the request's field, not the engine's
            msg = str(e)
            for engine_name, field in protocol.SAMPLING_NAMES.items():
                if msg.startswith(engine_name + " "):
                    msg = field + msg[len(engine_name) :]
            raise RequestError(msg) from None
        exclude = bool(_scalar(request, "exclude_input_in_output", self.exclude_input))
        stream = bool(_scalar(request, "streaming", False))
        perf = bool(_scalar(request, "return_perf_metrics", False))
        return ids, sampling, stream, [] if exclude else ids, logprobs, perf

    def _submit(self, request):
        sender = request.get_response_sender()
        if self.lost is not None:
            sender.send(_error(self.lost, pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
            return
        try:
            ids, sampling, stream, prefix, logprobs, perf = self._parse(request)
        except Exception as e:  # a bad request gets its error; the model stays up
            sender.send(_error(e if isinstance(e, KvqError) else RequestError(f"bad request: {e}")), flags=FINAL)
            return
        req = _Request(self, next(self.keys), sender, stream, prefix, logprobs, perf)
        with self.active_lock:  # before the engine hears of it: its first events find it here
            self.active[req.key] = req
        try:
            self.engine.submit(req.key, ids, sampling)
        except OSError:  # the engine process is gone; _on_lost fails the requests it knew of
            with self.active_lock:
                self.active.pop(req.key, None)
            sender.send(_error(self.lost or "the engine process is gone", pb_utils.TritonError.UNAVAILABLE),
                        flags=FINAL)

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None

    def forget(self, req, cancel_engine):
        with self.active_lock:
            self.active.pop(req.key, None)
        if cancel_engine:
            self.to_cancel.put(req.key)  # the watcher tells the engine (and counts it)

    def _publish_stats(self):
        new = []
        while not self.new_steps.empty():
            new += self.new_steps.get_nowait()
        self.metrics.steps(new)

    def _send_loop(self):
        while (req := self.outbox.get()) is not None:
            try:
                req.flush()
            except Exception as e:  # never let one response stop the others'
                pb_utils.Logger.log_error(f"kvq_engine: sending a response failed: {e!r}")

    def _watch(self):
        while not self.stopping.wait(CANCEL_POLL_S):
            self._publish_stats()
            while not self.to_cancel.empty():
                self.engine.cancel(self.to_cancel.get_nowait())  # a no-op if it finished meanwhile
                self.metrics.cancelled()
            with self.active_lock:
                reqs = list(self.active.values())
            for req in reqs:
                with req.lock:
                    # Never ask after the final response: Triton has freed that request's response
                    # factory, and tritonserver 2.51 segfaults on IsCancelled for it.
                    if req.done:
                        continue
                    gone = req.sender.is_cancelled()
                if gone:
                    req.close_cancelled()

    def finalize(self):
        self.stopping.set()
        self.watcher.join(timeout=5)
        # The engine process ends its requests in flight ("cancelled"), stops a tensor-parallel
        # engine's ranks (engine.json "tp") and exits; the reader delivers those last events.
        self.engine.stop()
        self.outbox.put(None)
        self.sender.join(timeout=5)
        self.metrics.close()
