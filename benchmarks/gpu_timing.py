"""GPU timing shared by the kernel benchmarks: graph-replayed GPU time, eager time, the
device's copy and read bandwidth ceilings, and the machine record (CUDA only)."""

from __future__ import annotations

import functools
import platform
import time
from functools import partial

import torch
import triton
from triton.testing import do_bench

_FLUSH: list[torch.Tensor] = []  # 256 MiB touched before every timed call: L2 (50 MB on the H200) starts cold
# How the L2 is emptied before a timed call. "write" zeroes the buffer: L2 is then full of dirty lines,
# and the timed kernel pays for writing them back to DRAM (up to 50 MB) as it evicts them -- a fixed
# cost that no kernel of a decode step meets (the GEMMs before attention leave clean weight lines),
# and that weighs most on the fastest kernel. "read" reduces the buffer instead: L2 holds clean lines
# of other data, as it does in a decode step. Both are kept so a run can show the difference.
# Measured on the H200: a 512 MiB read took 140.9 us after the write, 133.0 us
# after the read; 2 GiB 511 against 504 us; a read of 1 GiB empties L2 no better than 256 MiB.
FLUSH_MODES = ("read", "write")
DEFAULT_FLUSH = "read"


def gpu_env(**extra) -> dict:
    """The first JSONL row of a benchmark: GPU, versions, date (and whatever the caller adds)."""
    props = torch.cuda.get_device_properties(0)
    return {
        "kind": "env", "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **extra,
    }


def env_line(env: dict) -> str:
    """The machine sentence of a benchmark's Markdown table, from `gpu_env`'s row."""
    return (f"GPU {env['gpu']} ({env['sms']} SMs), torch {env['torch']}, triton {env['triton']}, "
            f"CUDA {env['cuda']}, Python {env['python']}, {env['date']}.")


def eager_ms(fn) -> float:
    """Median time of eager calls (triton's do_bench): host time included wherever the launches outlast the GPU."""
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def median_ms(fn, reps: int = 20, rounds: int = 5, flush: str = DEFAULT_FLUSH) -> float:
    """GPU time of one call of fn: a CUDA graph of reps x (L2 flush, fn) minus one of the flushes alone,
    median over rounds of replays. flush: one of FLUSH_MODES.

    Graphs take the host out of the number: at the 70B-per-GPU shapes the eager launcher's Python
    (split choice, allocations, the merge launch) outlasts the kernels, and eager timing measured
    it. The engine replays its decode steps from graphs too (runtime/cuda_graphs.py). Falls back
    to eager timing where fn cannot be captured (then host time is in).
    """
    if flush not in FLUSH_MODES:
        raise ValueError(f"flush={flush!r}: choose one of {FLUSH_MODES}")
    if not _FLUSH:
        _FLUSH.append(torch.zeros(256 << 20, dtype=torch.int8, device="cuda"))
        _FLUSH.append(torch.zeros(1, dtype=torch.int64, device="cuda"))
    buf, total = _FLUSH
    empty_l2 = buf.zero_ if flush == "write" else partial(torch.sum, buf.view(torch.int32), (0,), True, out=total)
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                empty_l2()
                if with_fn:
                    fn()
        return g

    try:
        both, flushes = capture(True), capture(False)
    except RuntimeError as e:
        print(f"  (graph capture failed, eager timing: {str(e)[:100]})", flush=True)
        return eager_ms(fn)

    def replay_ms(g: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    replay_ms(both), replay_ms(flushes)  # warm
    times = sorted((replay_ms(both) - replay_ms(flushes)) / reps for _ in range(rounds))
    return times[rounds // 2]


def ceilings(flush: str = DEFAULT_FLUSH) -> dict:
    """Device-to-device copy (read + write) and read-only reduction bandwidth, GB/s. The read is
    timed as the kernels are (`median_ms`, this flush); the copy eagerly (do_bench empties L2 by
    writing: over 4 GiB moved that costs ~0.3%)."""
    n = 2 << 30  # 2 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    # eager: captured in a graph, a device-to-device copy_ becomes a memcpy node served by the copy
    # engines (2.8 TB/s on the H200), not the SM copy kernel the ceiling is meant to measure
    copy_ms = eager_ms(partial(dst.copy_, src))
    del src, dst
    return {"copy_gbps": 2 * n / copy_ms / 1e6, "read_gbps": read_gbps(n, flush)}


def sum_gbps(nbytes: int, flush: str = DEFAULT_FLUSH) -> float:
    """GB/s of a bf16 sum over exactly `nbytes` (even), timed as the kernels are."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    return nbytes / median_ms(partial(x.sum, dtype=torch.float32), flush=flush) / 1e6


@functools.cache
def read_gbps(nbytes: int, flush: str = DEFAULT_FLUSH) -> float:
    """The read-only reduction's GB/s over about `nbytes` (a bf16 sum, timed as the kernels are): the best of
    three sizes within 3% of it, whole MiB, because PyTorch's reduction has size-dependent launch shapes (at
    0.57 GB, 17/16 of a power of two, it read 4% slower than at 0.55 GB). Below ~1 GB a read's fixed
    costs (launch, ramp-up, the last wave) show: on the H200 ~95% of the 2 GiB figure at 0.54 GB and ~84%
    at 0.13 GB (`results/read_by_size.jsonl`), so a kernel's share of the same-size read says what is
    left to gain in the kernel itself."""
    return max(sum_gbps(max(1, round(nbytes * f / 2**20)) * 2**20, flush) for f in (31 / 32, 1.0, 33 / 32))
