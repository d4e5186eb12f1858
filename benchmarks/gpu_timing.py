"""GPU timing shared by the kernel benchmarks: graph-replayed GPU time, eager time, the
device's copy and read bandwidth ceilings, and the machine record (CUDA only)."""

from __future__ import annotations

import platform
import time
from functools import partial

import torch
import triton
from triton.testing import do_bench

_FLUSH: list[torch.Tensor] = []  # 256 MiB written before every timed call: L2 (50 MB on the H200) starts cold


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


def median_ms(fn, reps: int = 20, rounds: int = 5) -> float:
    """GPU time of one call of fn: a CUDA graph of reps x (L2 flush, fn) minus one of the flushes alone,
    median over rounds of replays.

    Graphs take the host out of the number: at the 70B-per-GPU shapes the eager launcher's Python
    (split choice, allocations, the merge launch) outlasts the kernels, and eager timing measured
    it. The engine replays its decode steps from graphs too (runtime/cuda_graphs.py). Falls back
    to eager timing where fn cannot be captured (then host time is in).
    """
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device="cuda"))
    flush = _FLUSH[0]
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                flush.zero_()
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


def ceilings() -> dict:
    """Device-to-device copy (read + write) and read-only reduction bandwidth, GB/s."""
    n = 2 << 30  # 2 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    # eager: captured in a graph, a device-to-device copy_ becomes a memcpy node served by the copy
    # engines (2.8 TB/s on the H200), not the SM copy kernel the ceiling is meant to measure
    copy_ms = eager_ms(partial(dst.copy_, src))
    x = src.view(torch.bfloat16)
    read_ms = eager_ms(partial(x.sum, dtype=torch.float32))
    del src, dst
    return {"copy_gbps": 2 * n / copy_ms / 1e6, "read_gbps": n / read_ms / 1e6}
