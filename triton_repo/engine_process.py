"""The stub's side of the engine process (triton_repo/engine_worker.py): start it, talk to it, notice its end.

The worker runs in a python of the same environment: KVQ_WORKER_PYTHON (triton_repo/server.py sets it
to the stub environment's interpreter, whose site-packages names this source tree and sys.path), else
this interpreter when it is one (outside Triton), else the first python3 on PATH (the stub's own
environment goes first there): in the python backend, sys.executable may be the stub binary itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

from runtime.errors import KvqError, ServerError

PYTHON_ENV = "KVQ_WORKER_PYTHON"
STOP_TIMEOUT_S = 30.0  # the worker's own shutdown: the engine's last step, the tensor-parallel ranks
READY_POLL_S = 1.0

# (key, token, finished, finish_reason, logprob, (reused, new) blocks or None, (is_request_error, message) or None)
Event = tuple


def worker_python() -> str:
    python = os.environ.get(PYTHON_ENV)
    if not python and Path(sys.executable).name.startswith("python"):
        python = sys.executable  # an ordinary interpreter (not the stub): its own environment
    python = python or shutil.which("python3") or shutil.which("python")
    if not python:
        raise ServerError(
            f"no python to run the engine process: set {PYTHON_ENV} to the interpreter of the environment "
            "that has kvq installed (`kvq serve` sets it)."
        )
    return python


class EngineProcess:
    """One engine worker. `on_events(events, step_batch_sizes)` runs on this object's reader thread for
    every message of the worker; `on_exit(message)` once if the worker ends without being stopped."""

    def __init__(
        self,
        engine_dir: str,
        device: str,
        on_events: Callable[[list[Event], list[int]], None],
        on_exit: Callable[[str], None],
    ):
        self.on_events, self.on_exit = on_events, on_exit
        ours, theirs = socket.socketpair()
        # -c, not -m: under -m the worker's classes would belong to __main__, and a tensor-parallel
        # engine's spawned ranks could not unpickle StepEngine.from_dir by name.
        cmd = [worker_python(), "-c", "import sys; from triton_repo.engine_worker import main; sys.exit(main())",
               "--fd", str(theirs.fileno()), str(engine_dir), device or "auto"]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.send_lock = threading.Lock()  # execute(), the watcher and the sender threads all send
        self.stopping = False
        self.info = self._wait_ready()
        self.reader = threading.Thread(target=self._read, name="kvq-engine-reader", daemon=True)
        self.reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self) -> dict:
        """Block until the engine is loaded; a worker that fails (or dies) raises why."""
        while not self.conn.poll(READY_POLL_S):
            if self.proc.poll() is not None:
                self._close()
                raise KvqError(f"the engine process exited with code {self.proc.returncode} while loading; "
                               "its traceback is in the server log above.")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
            self._close()
            raise KvqError(f"the engine process exited with code {code} while loading; see the server log.") from None
        if msg[0] != "ready":
            self.proc.wait(timeout=STOP_TIMEOUT_S)
            self._close()
            raise KvqError(f"the engine did not load:\n{msg[1]}")
        return msg[1]

    def _send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def submit(self, key: int, prompt_ids: list[int], sampling) -> None:
        """Raises OSError when the worker is gone (the caller answers that request itself)."""
        self._send(("submit", key, prompt_ids, sampling))

    def cancel(self, key: int) -> None:
        try:
            self._send(("cancel", key))
        except OSError:  # gone: every request has had its error already
            pass

    def _read(self) -> None:
        while True:
            try:
                kind, events, sizes = self.conn.recv()
            except (EOFError, OSError):
                break
            if kind == "events":
                self.on_events(events, sizes)
        if self.stopping:
            return
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # closed its socket but lives on: it is of no use any more
            self.proc.kill()
            code = self.proc.wait()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        self.on_exit(f"the engine process (pid {self.proc.pid}) {how}")

    def stop(self) -> int | None:
        """Ask the worker to stop (its in-flight requests get their "cancelled" events), wait, kill if needed."""
        self.stopping = True
        try:
            self._send(("stop",))
        except OSError:
            pass
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"kvq_engine: the engine process {self.proc.pid} did not stop; killing it", file=sys.stderr)
            self.proc.kill()
            code = self.proc.wait()
        self.reader.join(timeout=STOP_TIMEOUT_S)
        self._close()
        return code

    def _close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
