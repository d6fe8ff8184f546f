"""Work a caller may stop (the API's start-up runs in a thread while the server already answers).

:func:`controlled` hands the work a :class:`WorkControl`. The work then stops at its next safe
point (a lock wait, a new temporary file or folder, a progress step of the caller's) by raising
:class:`Interrupted`, and what it has in progress is recorded (the temporary files of
`evaluator.artifacts`, the lock files of `evaluator.locks`), so the caller can remove it
(:meth:`WorkControl.abandon`) when the work cannot stop in time and the process exits without it.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path


class Interrupted(Exception):
    """Controlled work was asked to stop (:class:`WorkControl`); raised at a safe point."""


@dataclass(eq=False)
class WorkControl:
    """How the caller of long work in a thread steers it (see :func:`controlled`).

    ``stop`` asks the work to end: it raises :class:`Interrupted` at its next safe point (a
    lock wait, a new temporary file or folder, :meth:`check` in a progress callback).
    ``on_build(what)`` is told when the work takes a build lock, ``on_wait(message)`` when it
    waits for another process's (instead of the warning line). ``temps`` and ``locks``: the
    temporary files / folders it has in progress and the lock files it holds; ``cleanups``:
    what else :meth:`abandon` must undo (a child process to end), added by the work."""

    stop: threading.Event = field(default_factory=threading.Event)
    on_build: Callable[[str], None] | None = None
    on_wait: Callable[[str], None] | None = None
    guard: threading.Lock = field(default_factory=threading.Lock, repr=False)
    temps: set[Path] = field(default_factory=set)
    locks: set[Path] = field(default_factory=set)
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def check(self) -> None:
        """Raise :class:`Interrupted` once ``stop`` is set."""
        if self.stop.is_set():
            raise Interrupted("asked to stop")

    def abandon(self) -> list[Path]:
        """For a caller that cannot wait any longer for the work to stop (the process is
        exiting and the thread with it): set ``stop`` and remove the temporary files and
        folders it has in progress and the lock files it holds (the kernel frees the locks when
        the process ends). Returns what was removed. From now on it makes no temporary file."""
        with self.guard:
            self.stop.set()
            gone = sorted(self.temps | self.locks)
            for tmp in self.temps:
                if tmp.is_dir() and not tmp.is_symlink():
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    tmp.unlink(missing_ok=True)
            for path in self.locks:
                path.unlink(missing_ok=True)
            self.temps.clear()
            self.locks.clear()
            cleanups, self.cleanups = self.cleanups, []
        for cleanup in cleanups:
            cleanup()
        return gone


_CONTROL: ContextVar[WorkControl | None] = ContextVar("casi_work_control", default=None)


def current_control() -> WorkControl | None:
    """The :class:`WorkControl` of the work running in this thread (None: uncontrolled)."""
    return _CONTROL.get()


@contextmanager
def controlled(control: WorkControl) -> Iterator[WorkControl]:
    """Run the work of this block (in this thread) under ``control``."""
    token = _CONTROL.set(control)
    try:
        yield control
    finally:
        _CONTROL.reset(token)
