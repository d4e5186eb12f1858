"""Per-batch progress bars (rich) for the long stages: calibrate and evaluate.

`work_progress(enabled)` yields a `Bars`; `bars.task(label, total)` returns an
`advance(n)` callable that the work loops call once per batch. Disabled (tests,
library callers that want silence), every call is a no-op, so the loops look
the same either way. Bars go to stderr, so stdout stays machine-readable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

Advance = Callable[[int], None]


class Bars:
    def __init__(self, progress: Progress | None):
        self._progress = progress

    def task(self, label: str, total: int, unit: str = "tokens") -> Advance:
        if self._progress is None:
            return lambda n=1: None
        tid = self._progress.add_task(f"{label} ({unit})", total=total)
        return lambda n=1: self._progress.advance(tid, n)


@contextlib.contextmanager
def work_progress(enabled: bool = True) -> Iterator[Bars]:
    if not enabled:
        yield Bars(None)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        yield Bars(progress)
