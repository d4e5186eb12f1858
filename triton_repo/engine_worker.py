"""The kvq_engine model's engine process: the Engine and its step loop, away from the python backend's stub.

Why a process of its own: in the stub, every response send holds the GIL for ~150-200 us (numpy
tensors through the stub's IPC), once per token per stream, and the engine's step loop (Python
dispatch of kernels / CUDA graphs, token callbacks) waited on it: at 256 streams the served engine
stepped several times slower than the same engine in-process. Here the step loop shares its GIL
with nothing but one thread that ships each step's token events to the stub in one message.

Started by triton_repo/engine_process.py (`main(["--fd", N, ENGINE_DIR, DEVICE])` in a new python),
over one socket (multiprocessing.connection framing, pickled tuples):

  stub -> worker  ("submit", key, prompt_ids, SamplingParams) | ("cancel", key) | ("stop",)
  worker -> stub  ("ready", {"vocab_size", "pid"}) or ("failed", traceback text), once, first;
                  then ("events", [Event...], [step batch sizes]) per engine step (or per several,
                  when the stub reads slower than the engine steps): every token of the step in one
                  message. Event = (key, token or None, finished, finish_reason, logprob or None,
                  (reused, new) KV blocks on the final event or None, error or None), where error =
                  (is_request_error, message) for a request the engine refused at submit.

The worker exits when the stub closes its end of the socket or dies (recv sees EOF): no engine,
and no tensor-parallel rank, outlives the model.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import traceback
from multiprocessing.connection import Connection

from runtime import parallel
from runtime.engine import Engine
from runtime.errors import KvqError, RequestError

FLUSH_IDLE_S = 0.05  # events emitted outside a step (cancellations, a failed step) wait at most this long
EXIT_GRACE_S = 20.0  # a shutdown that hangs (a wedged device) ends with os._exit after this long

log = logging.getLogger("kvq.engine_worker")


class StepOutbox:
    """Token events of the engine's step loop, shipped to the stub by one thread, one message per step.

    The step loop's callbacks append to the current step's list; the step's end closes that list (with
    the count of steps so far) and wakes the thread. A stub that reads slowly makes the thread's send
    wait, never the step loop, and the closed lists of the steps in between go in its next message:
    a message carries whole steps, never a part of one. Events outside any step (a refused submit,
    the cancellations of a shutdown) go out within FLUSH_IDLE_S."""

    def __init__(self, conn: Connection, stats):
        self.conn, self.stats = conn, stats
        self.events: list[tuple] = []  # of the step under way (or of no step)
        self.closed_steps: list[tuple[list[tuple], int]] = []  # (events, steps so far) to send
        self.sizes_sent = 0
        self.cv = threading.Condition()  # every add takes it: uncontended, ~0.1 us a token
        self.in_step = False
        self.closed = False
        self.broken = False  # the stub is gone: drop what comes
        self.thread = threading.Thread(target=self._run, name="kvq-worker-outbox", daemon=True)
        self.thread.start()

    def add(self, event: tuple) -> None:
        with self.cv:
            self.events.append(event)

    def begin_step(self) -> None:
        with self.cv:
            self.in_step = True

    def end_step(self) -> None:
        with self.cv:
            self.in_step = False
            self._close_list()
            self.cv.notify()

    def _close_list(self) -> None:
        self.closed_steps.append((self.events, len(self.stats.step_batch_sizes)))
        self.events = []

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout=EXIT_GRACE_S)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not (self.closed_steps or self.closed):
                    if not self.cv.wait(FLUSH_IDLE_S) and not self.in_step and self.events:
                        self._close_list()  # idle: events of no step
                closing = self.closed
                if closing and self.events:
                    self._close_list()
                batches, self.closed_steps = self.closed_steps, []
            if batches and not self.broken:
                events = [e for evs, _ in batches for e in evs]
                mark = batches[-1][1]
                sizes = self.stats.step_batch_sizes[self.sizes_sent : mark]
                self.sizes_sent = mark
                if events or sizes:
                    try:
                        self.conn.send(("events", events, sizes))
                    except OSError:  # the stub went away; the main thread sees EOF and stops the engine
                        self.broken = True
            if closing:
                return


class StepEngine(Engine):
    """The Engine whose every step ends by handing that step's events to the outbox. A module-level
    class: a tensor-parallel engine's ranks are spawned with its from_dir, which pickles by name."""

    outbox: StepOutbox | None = None

    def _step(self) -> None:
        if self.outbox is not None:
            self.outbox.begin_step()
        try:
            super()._step()
        finally:
            if self.outbox is not None:
                self.outbox.end_step()


class Worker:
    def __init__(self, conn: Connection, engine):
        self.conn, self.engine = conn, engine
        self.outbox = StepOutbox(conn, engine.stats)
        engine.outbox = self.outbox
        self.engine_ids: dict[int, int] = {}  # stub key -> engine request id, while it runs
        # The stub's keys increase. A cancel may overtake its own submit (the stub registers a request
        # before sending it): such a key is remembered until its submit arrives, and never runs.
        self.last_key = -1
        self.cancelled_early: set[int] = set()

    def _callbacks(self, key: int):
        usage = [None]

        def on_finish(u) -> None:
            usage[0] = (u.reused_blocks, u.new_blocks)

        def on_token(tok, finished, reason, logprob=None) -> None:
            if finished:
                self.engine_ids.pop(key, None)
            self.outbox.add((key, tok, finished, reason, logprob, usage[0] if finished else None, None))

        return on_token, on_finish

    def submit(self, key: int, ids: list[int], sampling) -> None:
        self.last_key = max(self.last_key, key)
        if key in self.cancelled_early:
            self.cancelled_early.discard(key)
            return
        on_token, on_finish = self._callbacks(key)
        try:
            self.engine_ids[key] = self.engine.submit(ids, sampling, on_token, on_finish=on_finish)
        except KvqError as e:  # e.g. more KV blocks than the pool has: that request's error, nothing else's
            self.engine_ids.pop(key, None)
            self.outbox.add((key, None, True, "error", None, None, (isinstance(e, RequestError), str(e))))
            self.outbox.end_step()

    def serve(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the stub closed the socket or died
                log.warning("kvq_engine's stub process is gone: stopping the engine")
                return
            kind = msg[0]
            if kind == "submit":
                self.submit(*msg[1:])
            elif kind == "cancel":
                key = msg[1]
                rid = self.engine_ids.get(key)
                if rid is not None:
                    self.engine.cancel(rid)  # a no-op if it finished meanwhile
                elif key > self.last_key:
                    self.cancelled_early.add(key)
            elif kind == "stop":
                log.info("stopping the engine (the model is unloading)")
                return

    def stop(self) -> None:
        self.engine.shutdown()  # what was still running gets its "cancelled" event
        self.outbox.close()
        parallel.close_group()  # a tensor-parallel engine's ranks (engine.json "tp") stop with it


def _exit_anyway() -> None:
    timer = threading.Timer(EXIT_GRACE_S, os._exit, (1,))
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvq_engine worker", description=__doc__.splitlines()[0])
    p.add_argument("--fd", type=int, required=True, help="this end of the socket to the stub")
    p.add_argument("engine_dir")
    p.add_argument("device", help="cpu, cuda, cuda:N, or auto")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="kvq_engine worker %(process)d: %(message)s")
    log.setLevel(logging.INFO)  # its own start and stop lines; the engine's loggers stay at warnings
    conn = Connection(args.fd)
    try:
        engine = StepEngine.from_dir(args.engine_dir, device=None if args.device in ("", "auto") else args.device)
    except BaseException:  # noqa: BLE001 - the stub raises it from initialize(): the model fails to load
        try:
            conn.send(("failed", traceback.format_exc()))
        except OSError:
            pass
        return 1
    worker = Worker(conn, engine)
    conn.send(("ready", {"vocab_size": engine.cfg.vocab_size, "pid": os.getpid()}))
    try:
        worker.serve()
    finally:
        _exit_anyway()
        worker.stop()
        conn.close()
    log.info("engine stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
