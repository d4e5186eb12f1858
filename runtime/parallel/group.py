"""The tensor-parallel process group: one process per rank, over torch.distributed.

Two ways to get one:

* the engine starts it: `Engine.from_dir(path, tp=N)` in an ordinary process
  becomes rank 0 and spawns ranks 1..N-1 (torch.multiprocessing, start method
  "spawn"), each of which builds its own engine from the same arguments and
  serves rank 0's steps until rank 0 shuts down;
* torchrun starts it: under `torchrun --nproc-per-node N script.py` (RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set) every process calls
  `Engine.from_dir(path, tp=N)`; on ranks other than 0 the call serves until
  rank 0 shuts down, then returns its stopped engine.

gloo on CPU, NCCL on CUDA (rank r on GPU base + local rank). The NVLink
multicast paths stay off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set (unless the environment sets them) before the
group exists, in every rank.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import InputError, KvqError

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# How long ranks wait for each other (start-up, loading and every collective): a rank that died
# surfaces as an error after this long instead of a hang.
TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("KVQ_TP_TIMEOUT_S", "600")))

log = logging.getLogger("kvq.parallel")


@dataclass
class TPGroup:
    tp: int
    rank: int
    device: torch.device
    pg: dist.ProcessGroup | None = None  # None: the default (world) group
    owns_group: bool = True  # this module created the process group and destroys it
    workers: list = field(default_factory=list)  # processes rank 0 spawned (and must reap)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def min_int(self, value: int) -> int:
        """The smallest `value` over all ranks (what every rank's pool can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        return int(t.item())

    def close(self, abort: bool = False) -> None:
        """Destroy the group (if ours) and reap the ranks rank 0 spawned; `abort` (rank 0 failed
        while building its engine): kill them instead of waiting for them to stop."""
        global _ACTIVE
        if abort:
            for p in self.workers:
                p.kill()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        for p in self.workers:
            p.join(timeout=TIMEOUT.total_seconds())
            if p.is_alive():  # a rank that did not stop: never leave it behind
                p.kill()
                p.join()
        self.workers = []
        if _ACTIVE is self:
            _ACTIVE = None


_ACTIVE: TPGroup | None = None  # the group a spawned rank joined before building its engine


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(base: torch.device, local_rank: int) -> torch.device:
    if base.type != "cuda":
        return base
    index = (base.index or 0) + local_rank
    if index >= torch.cuda.device_count():
        raise InputError(f"tp needs GPU {index} but this machine has {torch.cuda.device_count()}; "
                         "lower tp or pick a lower device index.")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _init(rank: int, tp: int, device: torch.device, init_method: str) -> None:
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(_backend(device), init_method=init_method, rank=rank, world_size=tp,
                            timeout=TIMEOUT, **kw)


@contextmanager
def _main_not_reimported():
    """Spawned ranks need nothing from the caller's __main__ (their entry is `_worker_main`), but
    "spawn" re-runs a script's top level in every child -- a script (or the Triton python backend's
    stub) without an `if __name__ == "__main__"` guard would build engines recursively. Hide the
    main module's origin while the ranks start."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            setattr(main, k, None) if k == "__spec__" else delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, tp: int, device: str, init_method: str, path: str, kwargs: dict) -> None:
    """Entry of a rank spawned by rank 0: join, build the same engine, serve rank 0's steps."""
    global _ACTIVE
    from ..engine import Engine  # runtime.engine imports this package

    dev = _rank_device(torch.device(device), rank)
    _init(rank, tp, dev, init_method)
    _ACTIVE = TPGroup(tp, rank, dev)
    try:
        Engine.from_dir(path, **kwargs)  # returns when rank 0 shuts down
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        raise
    finally:
        if _ACTIVE is not None:
            _ACTIVE.close()


def join(tp: int, device: torch.device, path: str, kwargs: dict) -> TPGroup:
    """This process's place in a tp-way group, creating the group (and spawning its other
    ranks, which rebuild the engine from `path` and `kwargs`) when none exists."""
    if _ACTIVE is not None:  # a spawned rank
        if _ACTIVE.tp != tp:
            raise KvqError(f"rank {_ACTIVE.rank} joined a group of {_ACTIVE.tp}, but its engine asks for tp={tp}.")
        return _ACTIVE
    if dist.is_initialized():  # the caller (e.g. a torchrun script) made the group itself
        if dist.get_world_size() != tp:
            raise InputError(f"tp={tp} but the process group has {dist.get_world_size()} ranks; "
                             f"start {tp} processes (torchrun --nproc-per-node {tp}) or pass tp="
                             f"{dist.get_world_size()}.")
        rank = dist.get_rank()
        return TPGroup(tp, rank, _rank_device(device, int(os.environ.get("LOCAL_RANK", rank))), owns_group=False)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun
        if int(os.environ["WORLD_SIZE"]) != tp:
            raise InputError(f"tp={tp} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} processes; "
                             f"run torchrun --nproc-per-node {tp}.")
        rank = int(os.environ["RANK"])
        dev = _rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
        _init(rank, tp, dev, "env://")
        return TPGroup(tp, rank, dev)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("spawn")
    # daemonic: if this process dies, its ranks die with it instead of waiting forever
    workers = [ctx.Process(target=_worker_main, args=(r, tp, str(device), init_method, path, kwargs),
                           name=f"kvq-tp-rank{r}", daemon=True) for r in range(1, tp)]
    with _main_not_reimported():
        for p in workers:
            p.start()
    dev = _rank_device(device, 0)
    group = TPGroup(tp, 0, dev, workers=workers)
    try:
        _init(0, tp, dev, init_method)
    except BaseException:
        group.owns_group = False
        group.close(abort=True)
        raise
    return group
