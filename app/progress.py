"""Rich progress bars for long work (index builds, fits, warm starts, rollouts).

In a terminal a live bar; outside one (``nohup … > log``, make, CI) Rich draws nothing until the
end, so :func:`progress_bar` prints a plain line instead at most every `LOG_EVERY_S` seconds
(and at the end): done / total, the fields (e.g. the loss), elapsed and ETA.
"""

from __future__ import annotations

import sys
import time
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
# `error:` lines go to stderr, so `KEY=$(casi keys create … | tail -1)` never captures one and
# `2>/dev/null` hides them. Rich resolves sys.stderr at each print (test runners replace it);
# while a live display (a spinner, a bar) runs in a terminal, Rich routes stderr above it.
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)

LOG_EVERY_S = 30.0
"""Outside a terminal: seconds between two plain progress lines."""


def clock(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) of a duration."""
    s = max(0, int(round(seconds)))
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def progress_line(description: str, done: int, total: int | None, elapsed: float, info: str) -> str:
    """The plain progress line: ``description done/total info, elapsed m:ss, ETA m:ss``."""
    count = f"{done}/{total}" if total else str(done)
    eta = f", ETA {clock(elapsed / done * (total - done))}" if total and done else ""
    return f"{description} {count}{' ' + info if info else ''}, elapsed {clock(elapsed)}{eta}"


@contextmanager
def progress_bar(
    description: str, total: int | None, log_every_s: float | None = None
) -> Iterator[Callable[..., None]]:
    """Yield ``advance(n=1, info="")``; shows done/total, ``info`` (e.g. ``"loss 1.234"``),
    elapsed and remaining time. Outside a terminal, a plain line every ``log_every_s`` seconds
    (default `LOG_EVERY_S`) and one at the end."""
    every = LOG_EVERY_S if log_every_s is None else log_every_s
    live = console.is_terminal
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        transient=False,
        disable=not live,
    ) as prog:
        task = prog.add_task(description, total=total, info="")
        t0 = last = time.monotonic()
        done = printed = 0
        text = ""

        def line() -> None:
            nonlocal printed
            printed = done
            console.print(
                progress_line(description, done, total, time.monotonic() - t0, text),
                markup=False, highlight=False,
            )  # fmt: skip

        def advance(n: int = 1, info: str = "") -> None:
            nonlocal last, done, text
            done, text = done + n, info or text
            prog.update(task, advance=n, info=text)
            if not live and (time.monotonic() - last >= every or done == total):
                last = time.monotonic()
                line()

        yield advance
        if not live and done and printed != done:
            line()


def index_progress(total: int) -> AbstractContextManager[Callable[..., None]]:
    return progress_bar("Embedding corpus", total)
