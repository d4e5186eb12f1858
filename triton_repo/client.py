"""Clients for a kvq (or TensorRT-LLM) ensemble: HTTP /generate and gRPC streaming.

The request fields are TensorRT-LLM's ensemble fields (text_input, max_tokens,
temperature, top_k, top_p, random_seed, end_id, stop_words, bad_words, penalties,
return_log_probs, stream, ...), so these calls work against either repository. Server-side errors come back as
RequestError with the server's message; connection problems as ServerError.
"""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.errors import RequestError, ServerError

from .protocol import ENSEMBLE, ENSEMBLE_REQUEST

_FIELD_TYPES = {  # ensemble field -> (numpy dtype, Triton dtype), from protocol.ENSEMBLE_REQUEST
    f.name: ({"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": bool}[f.dtype], f.dtype)
    for f in ENSEMBLE_REQUEST
    if f.dtype in ("INT32", "UINT64", "FP32", "BOOL") and f.dims == (1,)
}
_STRING_FIELDS = ("text_input", "stop_words", "bad_words")


@dataclass
class GenerateRequest:
    """A request in tensorrtllm_backend's field names; None / empty fields are not sent."""

    prompt: str
    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    random_seed: int | None = None
    end_id: int | None = None
    pad_id: int | None = None
    stop_words: list[str] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    min_length: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    return_log_probs: bool | None = None
    exclude_input_in_output: bool | None = None  # None: the deployment's default (kvq: true)
    apply_chat_template: bool = False

    def fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"text_input": self.prompt, "max_tokens": self.max_tokens}
        for k in ("temperature", "top_k", "top_p", "random_seed", "end_id", "pad_id", "min_length",
                  "repetition_penalty", "presence_penalty", "frequency_penalty", "return_log_probs",
                  "exclude_input_in_output"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        for k in ("stop_words", "bad_words"):
            if getattr(self, k):
                d[k] = list(getattr(self, k))
        if self.apply_chat_template:
            d["apply_chat_template"] = True
        return d


def _http_base(url: str) -> str:
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


def post_generate(
    url: str, body: dict[str, Any], model: str = ENSEMBLE, timeout_s: float = 120.0
) -> dict[str, Any]:
    """POST a raw JSON body to /v2/models/<model>/generate; returns the JSON answer."""
    req = urllib.request.Request(
        f"{_http_base(url)}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read()).get("error", "")
        except (ValueError, AttributeError):
            msg = ""
        raise RequestError(f"the server rejected the request (HTTP {e.code}): {msg or e.reason}") from e
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise ServerError(f"cannot reach Triton at {url}: {e}; is `kvq serve` running there?") from e


def generate(url: str, request: GenerateRequest, model: str = ENSEMBLE, timeout_s: float = 120.0) -> str:
    """The complete generated text, through the HTTP generate endpoint."""
    return post_generate(url, request.fields(), model, timeout_s)["text_output"]


def grpc_inputs(request: GenerateRequest, stream: bool) -> list:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in {**request.fields(), "stream": stream}.items():
        if name in _STRING_FIELDS:
            values = [value] if isinstance(value, str) else value
            arr = np.array([[v.encode("utf-8") for v in values]], dtype=object)
            dtype = "BYTES"
        else:
            np_dtype, dtype = _FIELD_TYPES[name]
            arr = np.array([[value]], dtype=np_dtype)
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


@dataclass
class StreamEvent:
    text: str
    t: float  # time.perf_counter() at arrival
    final: bool
    has_output: bool  # False for the empty closing response of a stream whose last token came earlier
    output_log_probs: list[float] | None = None  # this response's tokens, with return_log_probs
    cum_log_prob: float | None = None  # all tokens so far, with return_log_probs


def stream(
    grpc_url: str,
    request: GenerateRequest,
    model: str = ENSEMBLE,
    timeout_s: float = 120.0,
    stream_tokens: bool = True,
) -> Iterator[StreamEvent]:
    """Yield text increments as they arrive over a gRPC stream; the last event has final=True."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        client.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))
        try:
            client.async_stream_infer(
                model, grpc_inputs(request, stream_tokens), enable_empty_final_response=True
            )
        except InferenceServerException as e:
            # The stream failed before the request went out; its cause went to the callback.
            try:
                cause = events.get(timeout=1.0)[1] or e
            except queue.Empty:
                cause = e
            raise ServerError(
                f"cannot stream from Triton at {grpc_url} ({cause}); is `kvq serve` running there?"
            ) from e
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result, error, t = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ServerError(f"no response from {grpc_url} within {timeout_s:.0f} s.") from None
            if error is not None:
                raise RequestError(f"the server rejected the request: {error}")
            final = result.get_response().parameters["triton_final_response"].bool_param
            out = result.as_numpy("text_output")
            text = (
                ""
                if out is None
                else "".join(x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in out.reshape(-1))
            )
            lps, cum = result.as_numpy("output_log_probs"), result.as_numpy("cum_log_probs")
            yield StreamEvent(
                text, t, final, out is not None,
                None if lps is None else lps.reshape(-1).tolist(),
                None if cum is None else float(cum.reshape(-1)[0]),
            )
            if final:
                return
    except InferenceServerException as e:
        raise ServerError(f"gRPC call to {grpc_url} failed: {e}") from e
    finally:
        try:
            client.stop_stream(cancel_requests=True)
        finally:
            client.close()


_METRIC_LINE = re.compile(r"^(kvq_engine_\w+)\{([^}]*)\}\s+([0-9.eE+-]+)$")


def engine_metrics(metrics_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """kvq_engine's Prometheus counters, summed over instances: steps by batch size, tokens, cancellations,
    and how many instances' engine processes serve (engines_up)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise ServerError(f"cannot read metrics at {metrics_url}: {e}") from e
    out: dict[str, Any] = {"steps_by_batch_size": {}, "generated_tokens": 0, "cancelled": 0, "engines_up": 0}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))), float(m.group(3))
        if name == "kvq_engine_steps_total":
            size = int(labels["batch_size"])
            out["steps_by_batch_size"][size] = out["steps_by_batch_size"].get(size, 0) + int(value)
        elif name == "kvq_engine_generated_tokens_total":
            out["generated_tokens"] += int(value)
        elif name == "kvq_engine_cancelled_total":
            out["cancelled"] += int(value)
        elif name == "kvq_engine_process_up":
            out["engines_up"] += int(value)
    return out
