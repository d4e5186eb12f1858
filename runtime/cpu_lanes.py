"""CPU decode matmuls split over the cores: a packed weight cut along its outputs, one part per lane.

At the row counts of decode (1-8 rows) oneDNN runs most of a small model's linears on one
thread whatever torch's thread count (SmolLM2's QKV and O at 1 row: one thread; gate/up: ~3:1;
measured with OMP_WAIT_POLICY=passive, where an OpenMP worker's CPU time is its work), so a
decode step used about one core of two. Here a weight [N, K] is packed as `parts` slices of its
N output rows; a product computes slice 0 on the calling thread and each other slice on a lane
thread of its own, every lane with a one-thread OpenMP team, and concatenates. Each output
element is the same K-long reduction by the same oneDNN kernel, so the product is bit for bit
the unsplit weight's (tests/test_cpu_lanes.py checks it at the model's shapes, 1-2048 rows and
1-2 threads). One-thread teams also avoid the stall of a multi-thread OpenMP team when another
job holds a core: a lane that is descheduled delays its slice only, not a barrier of every op.

Lanes need GNU OpenMP (torch's Linux builds ship libgomp) to give each lane thread a one-thread
team without touching torch's process-wide setting; elsewhere weights are not split.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import threading
from pathlib import Path

import torch

# Above this many rows (prefill, scoring) oneDNN's own threads split a GEMM well: the slices run
# one after another, each with torch's full thread count.
LANE_ROWS = 64


@functools.cache
def _omp_set_num_threads():
    """libgomp's omp_set_num_threads, which sets the calling thread's team size only (an OpenMP
    ICV is per thread), or None where torch does not run on GNU OpenMP."""
    maps = Path("/proc/self/maps")
    for line in maps.read_text().splitlines() if maps.exists() else ():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if os.path.basename(path).startswith("libgomp"):
            fn = ctypes.CDLL(path).omp_set_num_threads
            fn.argtypes, fn.restype = [ctypes.c_int], None
            return fn
    return None


def lanes_available() -> int:
    """How many slices `batch_invariant.pack_weight` cuts a weight into: torch's intra-op thread count (at most
    the cores), 1 where lanes cannot run (no GNU OpenMP, one thread) or KVQ_CPU_LANES=0 turns them off
    (the products' bits are the same either way; the switch compares the two speeds)."""
    if os.environ.get("KVQ_CPU_LANES", "1").strip() == "0":
        return 1
    n = min(torch.get_num_threads(), os.cpu_count() or 1)
    return n if n >= 2 and _omp_set_num_threads() is not None else 1


class SplitWeight:
    """A weight [N, K] packed as slices of its N rows (each from `pack`); multiplied by `split_linear`.
    Quacks like the packed tensor it replaces where kvq reads one: shape, dtype, device, numel(),
    element_size(), dim(), is_mkldnn (True: a layout for oneDNN, no indexing) and to_dense()."""

    is_mkldnn = True

    def __init__(self, w: torch.Tensor, parts: int, pack):
        n = w.shape[0]
        bounds = [n * i // parts for i in range(parts + 1)]
        self.parts = [pack(w[a:b].contiguous()) for a, b in zip(bounds, bounds[1:])]
        self.shape, self.dtype, self.device = w.shape, w.dtype, w.device

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.parts[0].element_size()

    def dim(self) -> int:
        return len(self.shape)

    def to_dense(self) -> torch.Tensor:
        return torch.cat([p.to_dense() for p in self.parts])


class _Lane(threading.Thread):
    """A thread with a one-thread OpenMP team that multiplies the slices it is handed."""

    def __init__(self, index: int):
        super().__init__(name=f"kvq-cpu-lane-{index}", daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.products = 0  # slices multiplied here (tests check that the lanes did the work)
        self.start()

    def run(self) -> None:
        # torch sizes a thread's OpenMP team from its process-wide setting at the thread's first op;
        # let it do so now, so that it does not undo the one-thread team set next
        torch.zeros(1) + 1
        _omp_set_num_threads()(1)
        while True:
            fn, x, w = self.jobs.get()
            try:
                self.done.put(fn(x, w))
                self.products += 1
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
                self.done.put(e)


_lanes: list[_Lane] = []
_lanes_lock = threading.Lock()
_in_use = threading.Lock()  # one product at a time on the lanes (two engines' threads may both multiply)


def _forget_lanes() -> None:
    """In a forked child: the parent's lane threads do not exist there; start new ones on demand."""
    global _lanes_lock, _in_use
    _lanes.clear()
    _lanes_lock, _in_use = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_forget_lanes)


def lanes(count: int) -> list[_Lane]:
    """The process's first `count` lane threads, started on first use (shared by every engine)."""
    with _lanes_lock:
        while len(_lanes) < count:
            _lanes.append(_Lane(len(_lanes)))
        return _lanes[:count]


def split_linear(x: torch.Tensor, w: SplitWeight, linear) -> torch.Tensor:
    """x [M, K] @ w^T with `linear` (oneDNN's product of one packed slice): the slices side by side."""
    first, rest = w.parts[0], w.parts[1:]
    if x.shape[0] > LANE_ROWS or torch.get_num_threads() < len(w.parts) or not _in_use.acquire(blocking=False):
        return torch.cat([linear(x, p) for p in w.parts], 1)
    try:
        return _on_lanes(x, first, rest, linear)
    finally:
        _in_use.release()


def _on_lanes(x: torch.Tensor, first, rest, linear) -> torch.Tensor:
    workers = lanes(len(rest))
    for lane, part in zip(workers, rest):
        lane.jobs.put((linear, x, part))
    threads = torch.get_num_threads()
    set_threads = _omp_set_num_threads()
    set_threads(1)  # this thread's slice beside the lanes', one core each
    try:
        out = [linear(x, first)]
    finally:
        set_threads(threads)
        results = [lane.done.get() for lane in workers]  # every lane's, so none is left for the next call
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return torch.cat(out + results, 1)
