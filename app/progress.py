"""Rich progress bars for long work (index builds, fits, warm starts, rollouts)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# Tables are wide: outside a terminal (make, CI logs) use 150 columns rather than Rich's 80.
console = Console(width=None if sys.stdout.isatty() else 150)


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``; shows done/total, elapsed and remaining time."""
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as prog:
        task = prog.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            prog.advance(task, n)

        yield advance


def index_progress(total: int) -> AbstractContextManager[Callable[[int], None]]:
    return progress_bar("Embedding corpus", total)
