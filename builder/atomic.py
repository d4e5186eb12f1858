"""Atomic output directories: build next to the target, rename into place.

Every stage and standalone command writes through `atomic_dir`, so an
interrupted or failed run never leaves a half-written checkpoint behind: the
target either does not change or appears complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from runtime.errors import InputError


@contextlib.contextmanager
def atomic_dir(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside `target`; on success it becomes `target`.

    The temp dir lives in the same parent so the final rename is atomic (same
    filesystem). On any exception it is removed, with the parent directories
    this call created, and the exception propagates.
    With `overwrite`, an existing target is replaced only after the new one is
    complete.
    """
    target = Path(target).absolute()
    if target.exists() and not overwrite:
        raise InputError(f"{target} already exists; choose another output directory or remove it first.")
    created = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the parents a failed write created (deepest first), so it leaves no trace."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:  # not empty (another writer uses it) or already gone
            return
