"""Closed-loop load against an in-process engine: N requests, at most C in flight.

Used by `kvq compare` (engines measured directly). Timestamps are taken in the
engine's token callback; TTFT is submit → first token, inter-token latency the
gaps between a request's tokens. The callback only queues events: all
submissions happen on this thread, never inside the engine's step loop.
"""

from __future__ import annotations

import queue
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from runtime.errors import StageError


@dataclass
class RequestTrace:
    submitted: float
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else float("nan")


def random_prompts(n: int, length: int, vocab: int, seed: int, avoid: set[int] = frozenset()) -> list[list[int]]:
    """The same prompts for every engine: token ids drawn from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append([t if t not in avoid else 3 for t in ids])
    return out


def run_closed_loop(engine: Any, prompts: list[list[int]], sampling: Any, concurrency: int,
                    timeout_s: float = 1800.0, keep_traces: bool = False) -> dict[str, Any]:
    """Summary of the run; with keep_traces also "traces": per request (submit time, token times)."""
    events: queue.Queue = queue.Queue()
    traces: dict[int, RequestTrace] = {}
    pending = list(range(len(prompts)))
    in_flight = 0
    done = 0
    steps_before = len(engine.stats.step_batch_sizes)

    def submit(i: int) -> None:
        def on_token(tok, finished, reason, i=i):
            events.put((i, tok, finished, reason, time.perf_counter()))

        traces[i] = RequestTrace(time.perf_counter())
        engine.submit(prompts[i], sampling, on_token)

    t0 = time.perf_counter()
    while pending and in_flight < concurrency:
        submit(pending.pop(0))
        in_flight += 1
    deadline = t0 + timeout_s
    while done < len(prompts):
        try:
            i, tok, finished, reason, t = events.get(timeout=max(0.1, deadline - time.perf_counter()))
        except queue.Empty:
            raise StageError(f"load run timed out after {timeout_s:.0f} s with {done}/{len(prompts)} done; "
                             "lower compare.num_requests or output_len.") from None
        if tok is not None:
            traces[i].token_times.append(t)
        if finished:
            traces[i].finish_reason = reason
            done += 1
            in_flight -= 1
            if pending:
                submit(pending.pop(0))
                in_flight += 1
    wall = time.perf_counter() - t0
    ttft = [tr.token_times[0] - tr.submitted for tr in traces.values() if tr.token_times]
    itl = [b - a for tr in traces.values() for a, b in zip(tr.token_times, tr.token_times[1:])]
    tokens = sum(len(tr.token_times) for tr in traces.values())
    batches = engine.stats.step_batch_sizes[steps_before:]
    errors = sum(1 for tr in traces.values() if tr.finish_reason not in ("length", "stop"))
    kept = {"traces": [(traces[i].submitted, traces[i].token_times) for i in sorted(traces)]} if keep_traces else {}
    return {
        **kept,
        "concurrency": concurrency,
        "requests": len(prompts),
        "generated_tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "ttft_p50_ms": percentile_ms(ttft, 50),
        "ttft_p99_ms": percentile_ms(ttft, 99),
        "itl_p50_ms": percentile_ms(itl, 50),
        "itl_p99_ms": percentile_ms(itl, 99),
        "mean_batch": statistics.fmean(batches) if batches else float("nan"),
        "max_batch": max(batches) if batches else 0,
        "errors": errors,
    }
