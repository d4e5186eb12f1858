"""Load test against a running deployment: N concurrent streams, M requests in all.

The streams are gRPC streams to the ensemble, or (with `openai_model`) streamed
chat completions from the OpenAI-compatible endpoint through the real `openai`
client. Each worker owns one client and sends its requests one after another, so
`concurrency` is the number of requests in flight. Per request we record the
arrival time of every token response: time to first token (TTFT) from the
send, inter-token latency (ITL) between consecutive tokens. Results are data
(one dict per request plus a summary), printed as a table by the CLI.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from runtime.errors import InputError, KvqError, ServerError

from .client import GenerateRequest, stream
from .protocol import ENSEMBLE

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Give me a short tip for learning Python.",
    "What does a compiler do?",
    "Name a famous painter.",
)


@dataclass
class RequestResult:
    index: int
    prompt: str
    ok: bool
    error: str | None = None
    text: str = ""
    start: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of every response that carried text
    token_texts: list[str] = field(default_factory=list)  # that response's text
    usage_tokens: int | None = None  # the server's own count of generated tokens, where it reports one

    @property
    def num_tokens(self) -> int:
        """Generated tokens: the server's count (OpenAI `usage`), else one per response. A server under load
        may put several tokens in one response, so the gRPC count is a lower bound there."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls_s(self) -> list[float]:
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []


def one_request(
    grpc_url: str, index: int, request: GenerateRequest, model: str, timeout_s: float
) -> RequestResult:
    res = RequestResult(index, request.prompt, ok=False, start=time.perf_counter())
    try:
        for ev in stream(grpc_url, request, model=model, timeout_s=timeout_s):
            if ev.has_output:
                res.token_times.append(ev.t)
                res.token_texts.append(ev.text)
                res.text += ev.text
        res.ok = True
    except KvqError as e:
        res.error = str(e)
    res.end = time.perf_counter()
    return res


def openai_client(base_url: str, timeout_s: float):
    """A worker's client. Built before its requests' clocks start: building one takes ~30 ms of CPU under
    the GIL (httpx's SSL context), so one per request serialized the workers' sends and counted in TTFT."""
    import openai

    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)


def one_openai_request(api, index: int, request: GenerateRequest, model: str) -> RequestResult:
    """One streamed chat (or, without apply_chat_template, text) completion on the worker's client `api`;
    a token time per content chunk."""
    import openai

    res = RequestResult(index, request.prompt, ok=False, start=time.perf_counter())
    kw = {"model": model, "max_tokens": request.max_tokens, "stream": True, "stream_options": {"include_usage": True},
          "temperature": 0.0 if request.temperature is None else request.temperature}
    if request.top_p is not None:
        kw["top_p"] = request.top_p
    if request.random_seed is not None:
        kw["seed"] = request.random_seed
    try:
        if request.apply_chat_template:
            chunks = api.chat.completions.create(messages=[{"role": "user", "content": request.prompt}], **kw)
            text_of = lambda c: c.choices[0].delta.content if c.choices else None  # noqa: E731
        else:
            chunks = api.completions.create(prompt=request.prompt, **kw)
            text_of = lambda c: c.choices[0].text if c.choices else None  # noqa: E731
        for chunk in chunks:
            text = text_of(chunk)
            if text:
                res.token_times.append(time.perf_counter())
                res.token_texts.append(text)
                res.text += text
            if getattr(chunk, "usage", None) is not None:  # the last chunk, with stream_options include_usage
                res.usage_tokens = chunk.usage.completion_tokens
        res.ok = True
    except openai.APIError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    return res


def openai_model_name(base_url: str, timeout_s: float = 10.0) -> str:
    """The one model an OpenAI endpoint serves (GET /v1/models)."""
    import openai

    try:
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s) as api:
            names = [m.id for m in api.models.list()]
    except openai.APIError as e:
        raise ServerError(f"cannot list models at {base_url}: {e}; is `kvq serve --openai-port` running?") from e
    if len(names) != 1:
        raise InputError(f"{base_url} serves {names}; pick one with --model.")
    return names[0]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q) * 1000.0) if values else None


def summarize(results: list[RequestResult], wall_s: float, concurrency: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.num_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in r.itls_s]
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "concurrency": concurrency,
        "wall_s": wall_s,
        "output_tokens": tokens,
        "responses": sum(len(r.token_times) for r in ok),
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_ms_p50": _pct(ttfts, 50),
        "ttft_ms_p99": _pct(ttfts, 99),
        "itl_ms_p50": _pct(itls, 50),
        "itl_ms_p99": _pct(itls, 99),
        "error_messages": sorted({r.error for r in results if r.error})[:5],
    }


def _share(indices: list[int], workers: int, url: str, max_tokens: int, prompts, model: str, timeout_s: float,
           openai: bool, request_fields: dict[str, Any], barrier=None) -> tuple[dict[int, RequestResult], float]:
    """Requests `indices` over `workers` threads, each with its own client, sending one request after another;
    and the CPU seconds this process spent while they ran. With a `barrier` (another process's share), the
    threads start when every share is ready."""
    results: dict[int, RequestResult] = {}
    todo = iter(indices)
    lock = threading.Lock()

    def worker(api) -> None:
        try:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                req = GenerateRequest(prompts[i % len(prompts)], max_tokens=max_tokens, **request_fields)
                if api is not None:
                    results[i] = one_openai_request(api, i, req, model)
                else:
                    results[i] = one_request(url, i, req, model, timeout_s)
        finally:
            if api is not None:
                api.close()

    n = min(workers, len(indices))
    apis = [openai_client(url, timeout_s) if openai else None for _ in range(n)]
    threads = [threading.Thread(target=worker, args=(apis[k],), name=f"kvq-bench-{k}") for k in range(n)]
    if barrier is not None:
        barrier.wait()
    cpu0 = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.process_time() - cpu0


def _share_process(queue, barrier, *args) -> None:
    try:
        queue.put(_share(*args, barrier=barrier))
    except BaseException as e:  # noqa: BLE001 - the parent reports it; never leave the others at the barrier
        barrier.abort()
        queue.put(f"{type(e).__name__}: {e}")


def _run_processes(processes: int, n: int, num_requests: int, args: tuple, timeout_s: float
                   ) -> tuple[dict[int, RequestResult], float, float]:
    """The requests in `processes` shares (every processes-th request), n workers in all; the clock starts when
    every share's clients are built. Returns the results, the wall time and the shares' CPU seconds."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # not fork: the parent may hold gRPC threads
    barrier, queue = ctx.Barrier(processes + 1), ctx.Queue()
    procs = [ctx.Process(target=_share_process, daemon=True,
                         args=(queue, barrier, list(range(k, num_requests, processes)),
                               n // processes + (k < n % processes), *args))
             for k in range(processes)]
    for p in procs:
        p.start()
    results: dict[int, RequestResult] = {}
    cpu = 0.0
    try:
        barrier.wait(timeout=120)
        t0 = time.perf_counter()
        for _ in procs:
            got = queue.get(timeout=timeout_s + 60)
            if isinstance(got, str):
                raise ServerError(f"a bench process failed: {got}")
            results.update(got[0])
            cpu += got[1]
        wall = time.perf_counter() - t0
    except threading.BrokenBarrierError:
        raise ServerError("a bench process failed before its requests started: "
                          f"{queue.get(timeout=10) if not queue.empty() else 'no message'}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results, wall, cpu


def run_bench(
    url: str,
    concurrency: int,
    num_requests: int,
    max_tokens: int = 16,
    prompts: tuple[str, ...] | list[str] = DEFAULT_PROMPTS,
    model: str = ENSEMBLE,
    timeout_s: float = 300.0,
    openai: bool = False,
    keep_token_times: bool = False,
    processes: int = 1,
    **request_fields: Any,
) -> dict[str, Any]:
    """Returns {"summary": {...}, "requests": [per-request dicts]}. With `openai`, `url` is the
    endpoint's base URL (http://HOST:PORT/v1) and `model` the served model name. `processes` > 1 spreads
    the workers over that many client processes: one Python client process saturates a core (the GIL) at
    a few thousand streamed responses a second, below what a GPU server sends at hundreds of streams."""
    if concurrency < 1 or num_requests < 1 or max_tokens < 1 or processes < 1:
        raise InputError("concurrency, requests, max_tokens and processes must each be at least 1.")
    if not prompts:
        raise InputError("no prompts to send; pass --prompt at least once.")
    n = min(concurrency, num_requests)
    args = (url, max_tokens, tuple(prompts), model, timeout_s, openai, request_fields)
    processes = min(processes, n)
    if processes == 1:
        t0 = time.perf_counter()
        results, cpu = _share(list(range(num_requests)), n, *args)
        wall = time.perf_counter() - t0
    else:
        results, wall, cpu = _run_processes(processes, n, num_requests, args, timeout_s)
    done = [results[i] for i in sorted(results)]
    rows = [{**asdict(r), "ttft_s": r.ttft_s, "num_tokens": r.num_tokens} for r in done]
    if not keep_token_times:
        for row in rows:
            del row["token_times"], row["token_texts"]
    return {"summary": {**summarize(done, wall, concurrency), "client_cpu_s": cpu}, "requests": rows}
