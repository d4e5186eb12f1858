"""Per-batch progress bars (rich) for the long stages: calibrate and evaluate.

`work_progress(enabled)` yields a `Bars`; `bars.task(label, total)` returns an
`advance(n)` callable that the work loops call once per batch. Disabled (tests,
library callers that want silence), every call is a no-op, so the loops look
the same either way. Bars go to stderr, so stdout stays machine-readable.
rich is imported only when bars are shown.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

Advance = Callable[[int], None]


class Bars:
    def __init__(self, progress=None):  # a rich.progress.Progress, or None: no bars
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
    # rich is imported only here: the GPU machine runs evaluations without it (progress off)
    from rich import progress as rp
    from rich.console import Console

    columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeElapsedColumn(),
               rp.TimeRemainingColumn())
    with rp.Progress(*columns, console=Console(stderr=True)) as progress:
        yield Bars(progress)
