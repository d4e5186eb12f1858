"""`kvq serve` after a crash: shared-memory regions it can prove are its own are cleaned, others are
left alone, and the crash is explained by the server's last lines, not by older ones. Model code in
the server imports the same kvq source tree as the process that started it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from triton_repo import shm_regions
from triton_repo.server import start_server

MODEL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        import runtime

        print("kvq-test: model code imports runtime from", runtime.__file__, flush=True)
        # A harmless line that looks like an error, written while loading: a crash later must not
        # be blamed on it.
        print("kvq-test: Error: an old warning during load", flush=True)

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x + 1)]))
        return out
"""


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVQ_STATE_DIR", str(tmp_path / "state"))
    return shm_regions.state_dir()


def _repo(root: Path) -> Path:
    model = root / "repo" / "plus_one"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'name: "plus_one" backend: "python" max_batch_size: 0 '
        'input [{name: "x" data_type: TYPE_INT32 dims: [1]}] '
        'output [{name: "y" data_type: TYPE_INT32 dims: [1]}]'
    )
    (model / "1" / "model.py").write_text(MODEL_PY)
    return root / "repo"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _region(prefix: str) -> Path:
    path = shm_regions.SHM_DIR / f"{prefix}test_region"
    path.write_bytes(b"\0" * 4096)
    return path


def test_only_regions_of_recorded_dead_servers_are_removed(state):
    dead, alive, reused = (shm_regions.new_prefix() for _ in range(3))
    foreign = shm_regions.new_prefix()  # looks like ours, but no record proves it
    files = {p: _region(p) for p in (dead, alive, reused, foreign)}
    try:
        shm_regions.record(dead, _dead_pid())
        shm_regions.record(alive, os.getpid())
        rec = shm_regions.record(reused, os.getpid())
        rec.write_text(rec.read_text().replace('"start_ticks": ', '"start_ticks": 1'))  # pid reused since
        removed = shm_regions.clean_stale()
        assert sorted(removed) == sorted(files[p].name for p in (dead, reused))
        assert not files[dead].exists() and not files[reused].exists()
        assert files[alive].exists() and files[foreign].exists()
        assert sorted(q.name for q in state.iterdir()) == [f"{alive}.json"]
    finally:
        for f in files.values():
            f.unlink(missing_ok=True)


@pytest.mark.slow
def test_a_killed_servers_regions_are_cleaned_by_the_next_start(state, tmp_path):
    repo = _repo(tmp_path)
    first = start_server(repo, ready_timeout_s=120, log_dir=tmp_path)
    prefix = first.shm_prefix
    assert shm_regions.regions(prefix), "the python backend made no region under the recorded prefix"
    os.killpg(first.process.pid, signal.SIGKILL)  # kill -9 of the server and its stubs
    first.process.wait(timeout=30)
    left = shm_regions.regions(prefix)
    assert left  # what a crash leaves behind
    with start_server(repo, ready_timeout_s=120, log_dir=tmp_path) as second:
        assert not shm_regions.regions(prefix)
        assert shm_regions.regions(second.shm_prefix)
    assert not shm_regions.regions(second.shm_prefix)  # a clean stop leaves nothing either
    assert not list(state.glob("*.json"))
    first._stopped = True


@pytest.mark.slow
def test_kvq_serve_reports_the_crashed_servers_last_lines(state, tmp_path):
    repo = _repo(tmp_path)
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "kvq"), "serve", str(repo), "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not any(ln.startswith("ready:") for ln in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    pid = int(re.search(r"tritonserver pid (\d+)", "".join(lines)).group(1))
    log = Path(re.search(r"log (\S+)\)", "".join(lines)).group(1))
    import runtime

    assert "an old warning during load" in log.read_text()
    # the stub imports this process's kvq (its source tree), not whatever the venv has installed
    assert f"imports runtime from {runtime.__file__}" in log.read_text()
    os.kill(pid, signal.SIGSEGV)  # tritonserver's handler writes its last words, then it dies
    assert proc.wait(timeout=60) == 9
    reader.join(timeout=5)
    out = "".join(lines)
    report = out[out.index("exited on its own") :]
    assert "Signal (11) received" in report, out
    assert "an old warning during load" not in report, out
