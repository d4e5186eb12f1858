"""One thread for the torch work of every CPU engine in a process.

torch's CPU ops run in parallel through OpenMP (libgomp), which gives every OS thread that starts
a parallel region a pool of worker threads of its own. Once two threads own pools -- the caller's,
which loaded the model, and an engine's step loop -- there are more OpenMP threads than cores, and
each of the hundreds of small parallel regions of a decode step (page gathers, copies, oneDNN GEMMs)
gets slower (libgomp spins only briefly for its workers then). On the 2-core development machine a
CPU engine decodes SmolLM2 1.22x (batch 1) to 1.28x (batch 8) faster with one pool than with two
(docs/numerics.md).

So a CPU engine loads, steps and scores on this one thread, whichever thread calls it: `run(fn)`
runs fn here and returns its result (or raises its exception). Engines on other devices call their
ops directly (`direct`): their host threads start few parallel regions, and CUDA's current stream
and device are per thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_here = threading.local()  # .inside: this thread is the compute thread


def _mark() -> None:
    _here.inside = True


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the compute thread; inline when called from it (a callback of a step may
    score or load through another engine)."""
    if getattr(_here, "inside", False):
        return fn(*args, **kwargs)
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvq-compute", initializer=_mark)
        future = _executor.submit(fn, *args, **kwargs)
    return future.result()


def direct(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the calling thread: `run`'s stand-in where one thread buys nothing."""
    return fn(*args, **kwargs)


def _forget_in_child() -> None:
    """A forked child has no compute thread: it starts its own on first use."""
    global _executor, _lock
    _executor, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
