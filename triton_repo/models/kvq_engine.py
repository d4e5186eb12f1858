"""Triton python model `kvq_engine`: our embedded engine behind a decoupled model.

Copied into <repo>/kvq_engine/1/model.py. One engine per model instance,
created in initialize(); execute() only validates and submits, and the engine's
own background loop batches every in-flight request continuously (Triton's
batching would only group requests that arrive together). Responses are sent
from the engine's token callback through each request's response sender:
one response per token when streaming (cumulative ids + how many were already
shown, so postprocessing can detokenize exactly), one final response otherwise.
A client that goes away (request cancelled, or the sender refuses) cancels its
engine request, so its blocks are freed and the batch goes on without it.
(tritonserver 2.51 does not pass an ensemble request's cancellation on to its
composing models: behind the ensemble an orphaned request runs to max_tokens.)
"""

import json
import queue
import threading
from collections import Counter

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.engine import Engine
from runtime.errors import KvqError, RequestError
from runtime.sampling import SamplingParams
from triton_repo import protocol

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_POLL_S = 0.1


def _scalar(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy().reshape(-1)
    if a.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got {a.size}.")
    return a[0].item()


class _Request:
    """One client request: its sender, what it has generated, and whether it is closed."""

    def __init__(self, model, sender, stream, stops):
        self.model, self.sender = model, sender
        self.stream, self.stops = stream, stops
        self.ids = []
        self.shown = 0
        self.done = False
        self.lock = threading.Lock()
        self.engine_id = None
        self.cancel_pending = False

    def _response(self, final):
        m = self.model
        lead = (1,) if m.max_batch else ()
        n = len(self.ids)
        tensors = [
            pb_utils.Tensor("output_ids", np.array(self.ids, dtype=np.int32).reshape(lead + (1, n))),
            pb_utils.Tensor("sequence_length", np.array([n], dtype=np.int32).reshape(lead + (1,))),
            pb_utils.Tensor("prev_length", np.array([self.shown], dtype=np.int32).reshape(lead + (1,))),
            pb_utils.Tensor("is_final", np.array([final], dtype=bool).reshape(lead + (1,))),
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _send(self, final, new_token):
        if final and self.stream and not new_token:
            self.sender.send(flags=FINAL)  # every token was already streamed
        else:
            self.sender.send(self._response(final=final), flags=FINAL if final else 0)
            self.shown = len(self.ids)

    def on_token(self, token_id, finished, finish_reason):
        """Called from the engine's step loop: keep it short and never raise into it."""
        engine_finished = finished
        with self.lock:
            if self.done:
                return
            stop_hit = False
            if token_id is not None:
                self.ids.append(int(token_id))
                stop_hit = protocol.ends_with_stop(self.ids, self.stops)
            final = finished or stop_hit
            if not (final or self.stream):
                return
            try:
                if finish_reason == "error" and token_id is None:
                    err = pb_utils.TritonError("the engine failed on this request; see the server log.")
                    self.sender.send(pb_utils.InferenceResponse(error=err), flags=FINAL)
                else:
                    self._send(final, token_id is not None)
            except Exception:  # the client is gone: stop generating for it
                final = True
            self.done = final
        if self.done:
            # After a stop word or a vanished client the engine would go on: cancel it there.
            self.model.forget(self, cancel_engine=not engine_finished)

    def close_cancelled(self):
        with self.lock:
            if self.done:
                return
            self.done = True
            try:
                self.sender.send(flags=FINAL)
            except Exception:  # nobody is listening any more; closing is best effort
                pass
        self.model.forget(self, cancel_engine=True)


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        engine_dir = params["engine_dir"]
        self.max_batch = cfg.get("max_batch_size", 0) > 0
        self.limits = protocol.EngineLimits.from_engine_dir(engine_dir)
        device = params.get("device", "auto")
        self.engine = Engine.from_dir(engine_dir, device=None if device in ("", "auto") else device)
        self.active = {}  # engine request id -> _Request still streaming
        self.active_lock = threading.Lock()  # lock order: _Request.lock, then active_lock
        self.to_cancel = queue.SimpleQueue()
        self.stopping = threading.Event()
        self._init_metrics(args.get("model_instance_name", "kvq_engine"))
        self.watcher = threading.Thread(target=self._watch, name="kvq-cancel-watch", daemon=True)
        self.watcher.start()

    # --------------------------------------------------------------- requests
    def _parse(self, request):
        ids = (
            pb_utils.get_input_tensor_by_name(request, "input_ids")
            .as_numpy()
            .reshape(-1)
            .astype(np.int64)
            .tolist()
        )
        max_tokens = int(_scalar(request, "request_output_len", 0))
        self.limits.check(len(ids), max_tokens)
        temperature = float(_scalar(request, "temperature", 0.0))
        top_k = int(_scalar(request, "runtime_top_k", 0))
        top_p = float(_scalar(request, "runtime_top_p", 1.0))
        if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
            raise RequestError(
                f"temperature {temperature} must be >= 0, top_k {top_k} >= 0 and top_p {top_p} in (0, 1]."
            )
        end_id = _scalar(request, "end_id", None)
        seed = _scalar(request, "random_seed", None)
        sw = pb_utils.get_input_tensor_by_name(request, "stop_words_list")
        stops = protocol.stop_sequences(sw.as_numpy() if sw is not None else None)
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=None if seed is None else int(seed),
            stop_token_ids=() if end_id is None else (int(end_id),),
        )
        return ids, sampling, stops, bool(_scalar(request, "streaming", False))

    def _submit(self, request):
        sender = request.get_response_sender()
        try:
            ids, sampling, stops, stream = self._parse(request)
        except Exception as e:  # a bad request gets its error; the model stays up
            msg = str(e) if isinstance(e, KvqError) else f"bad request: {e}"
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(msg)), flags=FINAL)
            return
        req = _Request(self, sender, stream, stops)
        try:
            # No lock is held across submit: the engine may call back from its own thread meanwhile.
            engine_id = self.engine.submit(ids, sampling, req.on_token)
        except KvqError as e:  # e.g. more KV blocks than the pool has
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)
            return
        with req.lock:
            req.engine_id = engine_id
            if not req.done:
                with self.active_lock:
                    self.active[engine_id] = req
            elif req.cancel_pending:
                self.to_cancel.put(engine_id)

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None

    def forget(self, req, cancel_engine):
        with req.lock:
            engine_id = req.engine_id
            if engine_id is None:  # finished before submit() returned; _submit handles it
                req.cancel_pending = req.cancel_pending or cancel_engine
                return
        with self.active_lock:
            self.active.pop(engine_id, None)
        if cancel_engine:
            # Cancelled from the watcher thread, never from inside the engine's own callback.
            self.to_cancel.put(engine_id)

    # ---------------------------------------------------------------- metrics
    def _init_metrics(self, instance):
        """Prometheus counters of the engine's own steps by batch size: the proof that it batches."""
        self.instance = instance
        self.step_metrics = {}
        self.steps_seen = 0
        try:
            self.steps_family = pb_utils.MetricFamily(
                name="kvq_engine_steps_total",
                description="Engine steps by batch size (sequences in the step)",
                kind=pb_utils.MetricFamily.COUNTER,
            )
            # Families must outlive their metrics: keep a reference to both.
            self.tokens_family = pb_utils.MetricFamily(
                name="kvq_engine_generated_tokens_total",
                description="Tokens generated by the engine",
                kind=pb_utils.MetricFamily.COUNTER,
            )
            self.tokens_metric = self.tokens_family.Metric(labels={"instance": instance})
            self.cancel_family = pb_utils.MetricFamily(
                name="kvq_engine_cancelled_total",
                description="Engine requests cancelled early (client gone, or a stop word)",
                kind=pb_utils.MetricFamily.COUNTER,
            )
            self.cancel_metric = self.cancel_family.Metric(labels={"instance": instance})
        except Exception as e:  # metrics disabled on this server: serving goes on without them
            pb_utils.Logger.log_warn(f"kvq_engine: no custom metrics ({e})")
            self.steps_family = None

    def _publish_stats(self):
        if self.steps_family is None:
            return
        sizes = self.engine.stats.step_batch_sizes
        new = sizes[self.steps_seen : len(sizes)]
        self.steps_seen += len(new)
        for size, count in Counter(new).items():
            metric = self.step_metrics.get(size)
            if metric is None:
                metric = self.steps_family.Metric(labels={"instance": self.instance, "batch_size": str(size)})
                self.step_metrics[size] = metric
            metric.increment(count)
        if new:
            self.tokens_metric.increment(sum(new))  # one token per sequence per step

    def _watch(self):
        while not self.stopping.wait(CANCEL_POLL_S):
            self._publish_stats()
            while not self.to_cancel.empty():
                self.engine.cancel(self.to_cancel.get_nowait())  # a no-op if it finished meanwhile
                if self.steps_family is not None:
                    self.cancel_metric.increment(1)
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
        self.engine.shutdown()
        # Metrics must go before their families (the stub crashes at exit otherwise).
        self.step_metrics.clear()
        self.tokens_metric = self.cancel_metric = None
        self.steps_family = self.tokens_family = self.cancel_family = None
