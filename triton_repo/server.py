"""Start and stop the real `tritonserver` that the nvidia-pytriton wheel ships.

Why the setup below: the python backend runs model code in a separate stub
process that embeds Python in isolated mode, so PYTHONPATH is ignored. The stub
finds its interpreter's prefix through PATH, so a private environment's `bin`
goes first on PATH (_stub_environment: it imports what this process imports);
the stub itself and tritonserver need the wheel's bundled
libraries and the matching libpython on LD_LIBRARY_PATH. The stub binary must
sit inside the backend directory, so we assemble a private backend directory
per server (pytriton does the same), which also keeps concurrent servers apart.

The server runs in its own process group: stopping it (SIGTERM, then SIGKILL
for anything left in that group) leaves no stub process behind, nor the engine
process that kvq_engine's stub starts with the stub environment's python
(KVQ_WORKER_PYTHON). Its python
backend's shared-memory regions carry a prefix recorded as its own
(shm_regions.py): they are removed when it stops, and by the next start if it
was killed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import ExternalToolMissing, InputError, ServerError

from . import shm_regions
from .engine_process import PYTHON_ENV as WORKER_PYTHON_ENV

EXIT_TIMEOUT_S = 10
CRASH_LINES = 40
# Log lines that say why a model did not load (Triton's error lines and the
# UNAVAILABLE rows of its model status table).
_FAILURE_LINE = re.compile(r"^E\d{4}|UNAVAILABLE|failed to load|Traceback|Error|error:", re.IGNORECASE)


def _pytriton_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise ExternalToolMissing(
            "tritonserver is not installed: kvq uses the one shipped in the nvidia-pytriton wheel. "
            "Install it with `pip install 'kvq[serve]'` (or `pip install nvidia-pytriton`)."
        )
    return Path(spec.origin).parent


def tritonserver_binary() -> Path:
    binary = _pytriton_dir() / "tritonserver" / "bin" / "tritonserver"
    if not binary.is_file():
        raise ExternalToolMissing(
            f"{binary} is missing; reinstall nvidia-pytriton "
            "(`pip install --force-reinstall nvidia-pytriton`)."
        )
    return binary


def check_stub_numpy() -> None:
    """The python backend stub of the tritonserver in nvidia-pytriton 0.7.0 is built for numpy 1 (the
    wheel requires numpy<2), and the stub imports the numpy this process would import. Under numpy 2
    every response tensor reaches the client with its shape but no bytes: refuse to start instead."""
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise ExternalToolMissing(
            f"numpy {numpy.__version__} is installed, but tritonserver's python backend stub (nvidia-pytriton) "
            "is built for numpy 1: every response would arrive without its tokens. Install numpy<2 where kvq "
            "serves (`pip install 'numpy<2'`, as nvidia-pytriton requires)."
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assemble_backends(workdir: Path) -> Path:
    """A backend directory whose python backend carries the stub for this interpreter."""
    dist = _pytriton_dir() / "tritonserver"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ExternalToolMissing(
            f"nvidia-pytriton has no python backend stub for Python {version} ({stub}); "
            "run kvq from a Python version the wheel supports (3.8-3.13)."
        )
    backends = workdir / "backends"
    python_backend = backends / "python"
    shutil.copytree(
        dist / "backends" / "python", python_backend, ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy2(stub, python_backend / "triton_python_backend_stub")
    return backends


def _stub_environment(workdir: Path) -> Path:
    """A tiny virtual environment for the python backend's stub; returns its bin directory.

    The stub embeds Python in isolated mode (no PYTHONPATH) and takes its prefix from the
    first python on PATH. Its site-packages holds one .pth file naming this process's own
    source tree first, then every directory on this process's sys.path: model code imports
    the same kvq (a worktree, a checkout carried to another machine) and the same packages
    (a venv, wheels unpacked with --target) as the process that starts the server.
    """
    import runtime

    env = workdir / "stub-env"
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = env / "lib" / version / "site-packages"
    site.mkdir(parents=True)
    base = Path(getattr(sys, "_base_executable", sys.executable) or sys.executable)
    (env / "pyvenv.cfg").write_text(
        f"home = {base.parent}\ninclude-system-site-packages = false\nversion = {sys.version.split()[0]}\n"
    )
    bin_dir = env / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3", version):
        (bin_dir / name).symlink_to(base)
    source_root = Path(runtime.__file__).resolve().parents[1]
    entries = [str(source_root)] + [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != source_root]
    (site / "kvq_stub_paths.pth").write_text("\n".join(dict.fromkeys(entries)) + "\n")
    return bin_dir


def server_env(stub_bin: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env_bin = stub_bin or Path(sys.prefix) / "bin"
    env["PATH"] = f"{env_bin}{os.pathsep}{env.get('PATH', '')}"
    # kvq_engine's engine process runs in the stub's environment (triton_repo/engine_process.py)
    env[WORKER_PYTHON_ENV] = str(stub_bin / "python3") if stub_bin else sys.executable
    libs = [str(_pytriton_dir().parent / "nvidia_pytriton.libs"), str(sysconfig.get_config_var("LIBDIR"))]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env.pop("PYTHONPATH", None)
    return env


@dataclass
class TritonServer:
    """A running tritonserver started by `start_server`; stop it with `stop()` or `with`."""

    repo: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    process: subprocess.Popen
    log_path: Path
    workdir: Path
    shm_prefix: str = ""
    ready_offset: int = 0  # log bytes written before the server became ready
    _stopped: bool = field(default=False, repr=False)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def failure_lines(self, limit: int = 40) -> list[str]:
        lines = [ln for ln in self.log_text().splitlines() if _FAILURE_LINE.search(ln)]
        return lines[-limit:]

    def last_lines(self, limit: int = CRASH_LINES) -> list[str]:
        """The server's last words: the log written since it became ready (its tail, at most `limit`
        lines), so a crash is explained by what the server said then, not by lines from its start-up."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.ready_offset)
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return []
        return [ln for ln in text.splitlines() if ln.strip()][-limit:]

    def crash_report(self) -> str:
        lines = self.last_lines()
        return "\n".join(lines) if lines else f"(the server wrote nothing after becoming ready; log: {self.log_path})"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                why = "\n".join(self.failure_lines()) or self.log_text()[-4000:]
                self.stop()
                raise ServerError(
                    f"tritonserver exited with code {self.process.returncode} "
                    f"while loading {self.repo}:\n{why}\n"
                    f"Fix the model named above and start again (full log: {self.log_path})."
                )
            if self.is_ready():
                self.ready_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
                return
            time.sleep(0.25)
        why = "\n".join(self.failure_lines()) or "(no error lines in the log)"
        self.stop()
        raise ServerError(
            f"tritonserver did not become ready within {timeout_s:.0f} s for {self.repo}:\n{why}\n"
            f"Raise --ready-timeout if the model is large, or read the full log: {self.log_path}."
        )

    def stop(self) -> int | None:
        """SIGTERM, wait for Triton's own exit timeout, then SIGKILL whatever is left of the group."""
        if self._stopped:
            return self.process.returncode
        self._stopped = True
        pgid = self.process.pid  # start_new_session=True: the group id is the server's pid
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=EXIT_TIMEOUT_S + 10)
            except subprocess.TimeoutExpired:
                pass
        try:
            # Python-backend stubs that outlived the server: they are in the session we created.
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.process.poll() is None:
            self.process.wait(timeout=10)
        if self.shm_prefix:  # a clean exit removed them already; a crash of the server did not
            shm_regions.release(self.shm_prefix)
        shutil.rmtree(self.workdir / "backends", ignore_errors=True)
        shutil.rmtree(self.workdir / "stub-env", ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    repo: str | Path,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    ready_timeout_s: float = 180.0,
    log_verbose: int = 0,
    log_dir: str | Path | None = None,
) -> TritonServer:
    """Start tritonserver on 127.0.0.1 for `repo` and return once /v2/health/ready answers."""
    repo = Path(repo).resolve()
    if not repo.is_dir() or not any(
        p.joinpath("config.pbtxt").is_file() for p in repo.iterdir() if p.is_dir()
    ):
        raise InputError(
            f"{repo} is not a Triton model repository (no <model>/config.pbtxt); "
            "create one with `kvq deploy`."
        )
    binary = tritonserver_binary()
    check_stub_numpy()
    shm_regions.clean_stale()  # what killed servers of ours left in /dev/shm
    shm_prefix = shm_regions.new_prefix()
    workdir = Path(tempfile.mkdtemp(prefix="kvq-triton-", dir=log_dir))
    backends = _assemble_backends(workdir)
    http_port = http_port or free_port()
    grpc_port = grpc_port or free_port()
    metrics_port = metrics_port or free_port()
    log_path = workdir / "tritonserver.log"
    cmd = [
        str(binary),
        f"--model-repository={repo}",
        f"--backend-directory={backends}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        # Metrics on loopback too: kvq_engine publishes its step batch sizes there.
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--metrics-address=127.0.0.1",
        f"--metrics-port={metrics_port}",
        "--disable-auto-complete-config",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        f"--log-verbose={log_verbose}",
        # One shared-memory namespace per server, recorded as ours once the process exists.
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env(_stub_environment(workdir)),
            start_new_session=True,
        )
    shm_regions.record(shm_prefix, process.pid)
    server = TritonServer(repo, http_port, grpc_port, metrics_port, process, log_path, workdir, shm_prefix)
    try:
        server.wait_ready(ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server
