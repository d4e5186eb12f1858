"""Atomic file writes: a temp file in the same directory, then os.replace.

A reader (or a crashed run) never sees a half-written accuracy.json or scale
file. (builder/atomic.py does the same for whole directories; calibration may
not import builder.)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    _atomic(path, lambda tmp: Path(tmp).write_text(text))


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n")


def save_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    _atomic(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp))
