"""The progress bars a run prints: one per point, counting failed requests."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kvpush_lab.bench.loadgen import OnDone
from kvpush_lab.bench.records import RequestRecord


def make_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[errors]} errors"),
        TimeElapsedColumn(),
        console=console,
    )


def advance(progress: Progress, task: TaskID) -> OnDone:
    """Move the point's bar on, counting failed requests."""
    num_errors = 0

    def on_done(record: RequestRecord) -> None:
        nonlocal num_errors
        num_errors += not record.is_ok
        progress.update(task, advance=1, errors=num_errors)

    return on_done
