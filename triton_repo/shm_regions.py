"""Shared-memory regions of the python backend: name them so they can be proven ours, clean up the dead.

Triton's python backend keeps one /dev/shm region per model instance and
removes them when it exits cleanly. When the server is killed (kill -9, OOM)
they stay behind, tens of MiB each time. Every server kvq starts gets a random
region prefix, and a record (prefix, server pid, that process's start time)
under the state directory. A later start removes the regions of a recorded
server whose process is gone (the start time tells a reused pid apart), and
only files under that prefix owned by this user: nothing kvq did not create
is touched.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def state_dir() -> Path:
    return Path(os.environ.get("KVQ_STATE_DIR") or Path.home() / ".cache" / "kvq") / "triton-shm"


def new_prefix() -> str:
    return f"kvq_{secrets.token_hex(6)}_"


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing ')'.
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def record(prefix: str, pid: int) -> Path:
    """Note that the server `pid` owns regions under `prefix` (written atomically)."""
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{prefix}.json"
    fd, tmp = tempfile.mkstemp(prefix=".rec.", dir=d)
    with os.fdopen(fd, "w") as f:
        json.dump({"prefix": prefix, "pid": pid, "start_ticks": _start_ticks(pid), "uid": os.getuid()}, f)
    os.replace(tmp, path)
    return path


def regions(prefix: str) -> list[Path]:
    """This user's /dev/shm entries under `prefix`."""
    if not SHM_DIR.is_dir():
        return []
    uid = os.getuid()
    out = []
    for p in SHM_DIR.iterdir():
        try:
            if p.name.startswith(prefix) and p.lstat().st_uid == uid:
                out.append(p)
        except FileNotFoundError:
            continue
    return out


def release(prefix: str) -> list[str]:
    """Remove the regions under `prefix` and its record (the caller knows its server has exited)."""
    removed = []
    for p in regions(prefix):
        try:
            p.unlink()
            removed.append(p.name)
        except FileNotFoundError:
            pass
    (state_dir() / f"{prefix}.json").unlink(missing_ok=True)
    return removed


def _is_alive(rec: dict) -> bool:
    ticks = _start_ticks(int(rec["pid"]))
    return ticks is not None and ticks == rec.get("start_ticks")


def clean_stale() -> list[str]:
    """Remove the regions of every recorded server that is no longer running; returns their names."""
    d = state_dir()
    if not d.is_dir():
        return []
    removed: list[str] = []
    for path in sorted(d.glob("kvq_*.json")):
        try:
            rec = json.loads(path.read_text())
            prefix = rec["prefix"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a record of ours (or half-written by a crashed writer): leave it
        if path.name != f"{prefix}.json" or not prefix.startswith("kvq_") or rec.get("uid") != os.getuid():
            continue
        if not _is_alive(rec):
            removed += release(prefix)
    return removed
