"""kvq_engine's engine process (triton_repo/engine_worker.py, engine_process.py): the boundary itself.

Without Triton: the worker's messages carry each engine step's token events together, the tokens are the
engine's own (called directly, one request at a time), a refused request gets its error alone, a killed
worker is reported, and a worker whose parent dies exits by itself. Through the real tritonserver: a
killed engine process fails the request in flight and every later one with a clear error (no hang),
the metrics report it gone, and stopping the server leaves no process and no shared-memory region.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import helpers_calibration as H
import numpy as np
import pytest
from helpers_triton import ENGINE_JSON

from runtime.sampling import SamplingParams
from triton_repo.engine_process import PYTHON_ENV, EngineProcess

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14], [20, 21]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("engine-process") / "engine"
    shutil.copytree(H.tiny_model_dir(), d)
    (d / "engine.json").write_text(json.dumps(ENGINE_JSON))
    return d


@pytest.fixture(scope="module")
def reference(engine_dir) -> list[list[int]]:
    from runtime.engine import Engine

    engine = Engine.from_dir(engine_dir, device="cpu")
    try:
        return [engine.generate([p], max_tokens=MAX_TOKENS)[0].token_ids for p in PROMPTS]
    finally:
        engine.shutdown()


class Collector:
    """What the worker sent: its messages, and the events by request key."""

    def __init__(self, want_finished: int):
        self.messages: list[tuple[list, list]] = []
        self.by_key: dict[int, list[tuple]] = {}
        self.exits: list[str] = []
        self.want = want_finished
        self.done = threading.Event()
        self.gone = threading.Event()

    def on_events(self, events, sizes):
        self.messages.append((events, sizes))
        for ev in events:
            self.by_key.setdefault(ev[0], []).append(ev)
        if sum(1 for evs in self.by_key.values() if evs[-1][2]) >= self.want:
            self.done.set()

    def on_exit(self, why):
        self.exits.append(why)
        self.gone.set()


def _alive(pid: int) -> bool:
    """Running (a zombie that nobody has reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_each_steps_tokens_cross_in_one_message_and_equal_the_engines(engine_dir, reference):
    got = Collector(want_finished=len(PROMPTS))
    proc = EngineProcess(str(engine_dir), "cpu", got.on_events, got.on_exit)
    try:
        assert proc.info["vocab_size"] == 49152 and proc.info["pid"] == proc.pid
        for key, ids in enumerate(PROMPTS):
            proc.submit(key, ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert got.done.wait(120), f"not every request finished: {got.by_key}"
    finally:
        code = proc.stop()
    assert code == 0 and not got.exits
    assert not _alive(proc.pid)
    for key, want in enumerate(reference):
        evs = got.by_key[key]
        assert [e[1] for e in evs] == want
        assert [e[2] for e in evs] == [False] * (len(want) - 1) + [True]
        assert evs[-1][3] in ("length", "stop") and evs[-1][5] is not None  # KV usage on the final event
    assert sum(len(events) for events, _ in got.messages) == sum(map(len, reference))
    # Every sequence of a step gets a token here (the prompts prefill in one step), so a message that
    # carries whole steps has as many events as its steps' batch sizes add up to: never part of a step.
    assert [len(events) for events, _ in got.messages] == [sum(sizes) for _, sizes in got.messages]
    assert max(max(sizes, default=0) for _, sizes in got.messages) == len(PROMPTS)  # batched decode steps


def test_a_refused_request_gets_its_error_and_the_others_their_tokens(engine_dir, reference):
    got = Collector(want_finished=2)
    proc = EngineProcess(str(engine_dir), "cpu", got.on_events, got.on_exit)
    try:
        proc.submit(0, PROMPTS[0], SamplingParams(max_tokens=10_000))  # beyond max_seq_len
        proc.submit(1, PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS))
        assert got.done.wait(120), got.by_key
    finally:
        proc.stop()
    (refused,) = got.by_key[0]
    assert refused[1:4] == (None, True, "error")
    is_request_error, message = refused[6]
    assert is_request_error and "max_seq_len" in message
    assert [e[1] for e in got.by_key[1]] == reference[1]


def test_a_cancel_ends_its_request_even_when_it_overtakes_the_submit(engine_dir, reference):
    got = Collector(want_finished=2)
    started = threading.Event()
    proc = EngineProcess(str(engine_dir), "cpu", lambda events, sizes: (got.on_events(events, sizes),
                                                                        2 in got.by_key and started.set()),
                         got.on_exit)
    try:
        proc.cancel(1)  # the stub registers a request before it sends it: its cancel can come first
        proc.submit(1, PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS))
        proc.submit(2, PROMPTS[1], SamplingParams(max_tokens=100))
        assert started.wait(60)
        proc.cancel(2)
        proc.submit(3, PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS))
        assert got.done.wait(120), got.by_key
    finally:
        proc.stop()
    assert 1 not in got.by_key  # never ran
    last = got.by_key[2][-1]
    assert last[1:4] == (None, True, "cancelled") and len(got.by_key[2]) < 100
    assert [e[1] for e in got.by_key[3]] == reference[2]


def test_a_killed_engine_process_is_reported_and_refuses_more_work(engine_dir):
    got = Collector(want_finished=1)
    proc = EngineProcess(str(engine_dir), "cpu", got.on_events, got.on_exit)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        assert got.gone.wait(30), "the reader never noticed the engine process died"
        assert got.exits == [f"the engine process (pid {proc.pid}) was killed by signal 9"]
        with pytest.raises(OSError):
            proc.submit(0, PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS))
    finally:
        proc.stop()
    assert len(got.exits) == 1  # stop() after the death reports nothing more


PARENT = r"""
import sys, time
from triton_repo.engine_process import EngineProcess
p = EngineProcess(sys.argv[1], "cpu", lambda events, sizes: None, lambda why: None)
print(p.pid, flush=True)
time.sleep(600)
"""


def test_the_engine_process_exits_when_its_parent_dies(engine_dir):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(engine_dir)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), PYTHON_ENV: sys.executable})
    try:
        worker = int(parent.stdout.readline())
        assert _alive(worker)
    finally:
        parent.kill()  # SIGKILL: no finalize, no stop message
        parent.wait()
    assert _wait_gone(worker, 30), f"the engine process {worker} outlived its parent"


def test_a_worker_that_cannot_load_its_engine_explains_why(tmp_path):
    from runtime.errors import KvqError

    with pytest.raises(KvqError, match="the engine did not load:(.|\n)*is not a directory"):
        EngineProcess(str(tmp_path / "missing"), "cpu", lambda e, s: None, lambda why: None)


# ------------------------------------------------------------------ through tritonserver


def _group_pids(pgid: int, needle: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getpgid(int(d.name)) == pgid and needle in (d / "cmdline").read_bytes().decode(errors="replace"):
                out.append(int(d.name))
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return [p for p in out if _alive(p)]


def _stream(url: str, ids: list[int], max_tokens: int, timeout_s: float = 60) -> list:
    """(result, error) of every response of one streamed kvq_engine request, until the final one or an error."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, arr, dtype in [
        ("input_ids", np.array([ids], dtype=np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], dtype=np.int32), "INT32"),
        ("request_output_len", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        ("streaming", np.array([[True]]), "BOOL"),
    ]:
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    got, end = [], threading.Event()

    def on_response(result, error):
        got.append((result, error))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            end.set()

    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=on_response)
    try:
        c.async_stream_infer("kvq_engine", inputs, enable_empty_final_response=True)
        assert end.wait(timeout_s), f"no final response or error within {timeout_s} s: {got}"
    finally:
        c.stop_stream()
        c.close()
    return got


def _start_server(engine_dir, tmp_path, monkeypatch):
    """A real tritonserver serving engine_dir on the CPU, its shm records under tmp_path."""
    from triton_repo.repo_torch import write_repository
    from triton_repo.server import start_server

    monkeypatch.setenv("KVQ_STATE_DIR", str(tmp_path / "state"))
    repo = tmp_path / "repo"
    repo.mkdir()
    write_repository(engine_dir, repo, {"device": "cpu"})
    return start_server(repo, ready_timeout_s=180, log_dir=tmp_path)


@pytest.mark.slow
def test_a_dead_engine_process_fails_its_requests_and_the_server_stops_clean(engine_dir, tmp_path, monkeypatch):
    from triton_repo import client, shm_regions

    server = _start_server(engine_dir, tmp_path, monkeypatch)
    try:
        pgid = server.process.pid
        (worker,) = _group_pids(pgid, "triton_repo.engine_worker")
        served = _stream(server.grpc_url, PROMPTS[0], MAX_TOKENS)
        assert all(e is None for _, e in served)
        assert client.engine_metrics(server.metrics_url)["engines_up"] == 1
        # Freeze the engine so the next request is surely in flight when it dies.
        os.kill(worker, signal.SIGSTOP)
        pending: list = []
        t = threading.Thread(target=lambda: pending.extend(_stream(server.grpc_url, PROMPTS[1], 40)))
        t.start()
        time.sleep(1.0)
        os.kill(worker, signal.SIGKILL)
        t.join(timeout=60)
        assert not t.is_alive(), "the request in flight hung after its engine died"
        ((_, error),) = pending
        assert error is not None and "killed by signal 9" in str(error), error
        after = _stream(server.grpc_url, PROMPTS[2], MAX_TOKENS)
        ((_, error),) = after
        assert error is not None and "cannot serve until the model is reloaded" in str(error), error
        assert client.engine_metrics(server.metrics_url)["engines_up"] == 0
        assert server.is_ready()  # the server itself stays up for its other models
    finally:
        server.stop()
    assert not _group_pids(pgid, "")
    assert not shm_regions.regions(server.shm_prefix)


@pytest.mark.slow
def test_stopping_the_server_stops_the_engine_process_through_finalize(engine_dir, tmp_path, monkeypatch):
    server = _start_server(engine_dir, tmp_path, monkeypatch)
    try:
        (worker,) = _group_pids(server.process.pid, "triton_repo.engine_worker")
        assert all(e is None for _, e in _stream(server.grpc_url, PROMPTS[0], MAX_TOKENS))
    finally:
        server.stop()
    log = server.log_text()
    assert f"kvq_engine worker {worker}: engine stopped" in log, log[-3000:]
    assert "did not stop; killing it" not in log
    assert not _alive(worker)
