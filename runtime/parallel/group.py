"""The tensor-parallel process group: one process per rank, over torch.distributed.

Two ways to get one:

* the engine starts it: `Engine.from_dir(path, tp=N)` in an ordinary process
  becomes rank 0 and spawns ranks 1..N-1 (start method "spawn"). The group then
  outlives the engine: the next `from_dir(..., tp=N)` in the process sends its
  arguments to the waiting ranks instead of starting new processes (one
  tensor-parallel engine at a time). `close_group()` -- also run at exit --
  stops the ranks.
* torchrun starts it: under `torchrun --nproc-per-node N script.py` (RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set) every process calls
  `Engine.from_dir(path, tp=N)`; on ranks other than 0 the call serves until
  rank 0 shuts the engine down, then returns the stopped engine.

gloo on CPU (each rank takes its share of the cores), NCCL on CUDA (rank r on
GPU base + local rank). The NVLink multicast paths stay off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set (unless the
environment sets them) before the group exists, in every rank.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import multiprocessing
import os
import shutil
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
    spawned: bool = False  # rank 0 started the other ranks; they wait for engine arguments between engines
    workers: list = field(default_factory=list)  # processes rank 0 spawned (and must reap)
    busy: bool = False  # an engine is running on the group
    pg: dist.ProcessGroup | None = None  # None: the default (world) group

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def min_int(self, value: int) -> int:
        """The smallest `value` over all ranks (what every rank's pool can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        return int(t.item())

    def send_engine(self, args: tuple[str, dict] | None) -> None:
        """Rank 0 of a spawned group: the next engine's (path, from_dir arguments), None: exit."""
        dist.broadcast_object_list([args], 0, group=self.pg, device=self.device)

    def recv_engine(self) -> tuple[str, dict] | None:
        box = [None]
        dist.broadcast_object_list(box, 0, group=self.pg, device=self.device)
        return box[0]

    def close(self, abort: bool = False) -> None:
        """Stop the spawned ranks (`abort`: kill them, rank 0 failed mid-engine), destroy the group."""
        global _GROUP
        if self.is_driver and self.spawned and not abort:
            try:
                self.send_engine(None)
            except Exception:  # noqa: BLE001 - a rank that cannot hear the stop is killed below
                abort = True
        if abort:
            for p in self.workers:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in self.workers:
            p.join(timeout=60)
            if p.is_alive():  # a rank that did not stop: never leave it behind
                p.kill()
                p.join()
        self.workers = []
        if _GROUP is self:
            _GROUP = None
            torch.set_num_threads(_THREADS_BEFORE[0])


_ACTIVE: TPGroup | None = None  # a spawned rank's group
_GROUP: TPGroup | None = None  # the group this process leads (rank 0), or its torchrun rank
_THREADS_BEFORE = [torch.get_num_threads()]


def close_group() -> None:
    """Stop the tensor-parallel ranks this process started (runs at exit too)."""
    if _GROUP is not None:
        _GROUP.close(abort=_GROUP.busy)


atexit.register(close_group)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(base: torch.device, local_rank: int, tp: int) -> torch.device:
    if base.type != "cuda":
        # ranks share the cores: more threads than cores each would spin against the others
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
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


def _python() -> str:
    """The interpreter the ranks run on: this one, or -- where this process is not a python binary
    (the Triton python backend's stub embeds Python) -- the first python3 on PATH, which a kvq
    deployment points at the project's virtual environment."""
    exe = sys.executable or ""
    if os.path.basename(exe).startswith("python"):
        return exe
    found = shutil.which("python3")
    if found is None:
        raise KvqError(f"cannot start tensor-parallel ranks: this process runs {exe!r}, not python, and no "
                       "python3 is on PATH; put the environment's bin directory first on PATH.")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when rank 0 dies, even by SIGKILL (a daemonic process is only
    stopped by its parent's orderly exit)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _worker_main(rank: int, tp: int, device: str, init_method: str, build) -> None:
    """Entry of a rank spawned by rank 0: build each engine rank 0 builds (`build`: Engine.from_dir,
    passed in because runtime.engine imports this package), serve its steps."""
    global _ACTIVE
    _die_with_parent()
    dev = _rank_device(torch.device(device), rank, tp)
    _init(rank, tp, dev, init_method)
    _ACTIVE = TPGroup(tp, rank, dev, spawned=True)
    try:
        while (args := _ACTIVE.recv_engine()) is not None:
            path, kwargs = args
            try:
                build(path, **kwargs)  # returns when rank 0 shuts the engine down
            except Exception:  # noqa: BLE001 - rank 0 sees the same error (same arguments, same files)
                log.exception("tensor-parallel rank %d could not build its engine", rank)
            gc.collect()  # the stopped engine's pool goes before the next engine sizes its own
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(tp: int, device: torch.device, build) -> TPGroup:
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("spawn")
    ctx.set_executable(_python())
    # daemonic: if this process dies, its ranks die with it instead of waiting forever
    workers = [ctx.Process(target=_worker_main, args=(r, tp, str(device), init_method, build),
                           name=f"kvq-tp-rank{r}", daemon=True) for r in range(1, tp)]
    with _main_not_reimported():
        for p in workers:
            p.start()
    _THREADS_BEFORE[0] = torch.get_num_threads()
    group = TPGroup(tp, 0, _rank_device(device, 0, tp), spawned=True, workers=workers)
    try:
        _init(0, tp, group.device, init_method)
    except BaseException:
        group.close(abort=True)
        raise
    return group


def join(tp: int, device: torch.device, path: str, kwargs: dict, build) -> TPGroup:
    """This process's place in a tp-way group for one engine, starting the group when none exists
    (the spawned ranks then call `build(path, **kwargs)`, as this process did)."""
    global _GROUP
    if _ACTIVE is not None:  # a spawned rank, building what rank 0 sent
        if _ACTIVE.tp != tp:
            raise KvqError(f"rank {_ACTIVE.rank} joined a group of {_ACTIVE.tp}, but its engine asks for tp={tp}.")
        return _ACTIVE
    if _GROUP is not None and _GROUP.busy:
        raise InputError("another tensor-parallel engine is running in this process; shut it down "
                         "(engine.shutdown()) before building the next one.")
    if _GROUP is not None and (_GROUP.tp, _GROUP.device.type) != (tp, device.type):
        close_group()
    if _GROUP is None and "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun
        if int(os.environ["WORLD_SIZE"]) != tp:
            raise InputError(f"tp={tp} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} processes; "
                             f"run torchrun --nproc-per-node {tp}.")
        rank = int(os.environ["RANK"])
        dev = _rank_device(device, int(os.environ.get("LOCAL_RANK", rank)), tp)
        if not dist.is_initialized():
            _init(rank, tp, dev, "env://")
        _GROUP = TPGroup(tp, rank, dev)
    if _GROUP is None:
        _GROUP = _spawn(tp, device, build)
    if _GROUP.spawned:
        _GROUP.send_engine((path, kwargs))
    _GROUP.busy = True
    return _GROUP


def release(group: TPGroup) -> None:
    """The engine on `group` has shut down: the group takes the next one."""
    group.busy = False
