"""The inter-process locks around CASI's builds and cells.

:func:`build_lock` is the lock around every build: a second process waits for the first and then
reuses what it wrote; the lock file records the holder's process id while it is held (the waiter
says whom it waits for) and is removed when the holder lets go. :func:`lock_if_free` takes a lock
only when nobody holds it (a cell, the API's start-up). Under controlled work
(`evaluator.work_control`) a wait polls for a stop request and the lock file is recorded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock

from evaluator.work_control import current_control

log = logging.getLogger(__name__)


def lock_path(target: Path) -> Path:
    """The lock file guarding ``target`` (a hidden sibling while the lock is held)."""
    target = Path(target)
    return target.with_name(f".{target.name}.lock")


_LOCKS: dict[str, filelock.FileLock] = {}  # one per path: re-entrant within this process
WAIT_POLL_S = 0.25
"""Controlled work waiting for a lock looks this often whether it was asked to stop."""


def process_lock(target: Path) -> filelock.FileLock:
    """The (re-entrant) inter-process lock object of ``target``."""
    path = lock_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = str(path.resolve())
    if key not in _LOCKS:
        _LOCKS[key] = filelock.FileLock(key)
    return _LOCKS[key]


@contextmanager
def build_lock(target: Path, what: str | None = None) -> Iterator[None]:
    """Hold the inter-process lock of ``target``; say so when another process holds it,
    naming it by the process id its lock file records.

    While held, the lock file records this process's id; it is removed before the lock is let
    go (a waiter that opened the old file sees it unlinked and takes a fresh one: filelock
    checks the link count after locking), so no lock file outlives its build. Under
    :func:`controlled` work the wait polls for a stop request and the control is told what is
    waited for (``on_wait``) and what is being built (``on_build``)."""
    lock = process_lock(target)
    path = lock_path(target)
    control = current_control()
    name = what or str(target)
    if control is not None:
        control.check()
    if not _try_acquire(lock, 0):
        holder = lock_holder(target)
        message = f"waiting for another casi process building {name}" + (
            f" (pid {holder})" if holder is not None else ""
        )
        if control is None or control.on_wait is None:
            log.warning("%s", message)
        if control is None:
            lock.acquire()
        else:
            if control.on_wait is not None:
                control.on_wait(message)
            while not _try_acquire(lock, WAIT_POLL_S):
                control.check()
    first = lock.lock_counter == 1  # re-entered: the outer hold records and removes
    try:
        if first:
            _record_holder(lock, path)
            if control is not None:
                with control.guard:
                    control.locks.add(path)
        if first and control is not None and control.on_build is not None:
            control.on_build(name)
        yield
    finally:
        if first:
            if control is not None:
                with control.guard:
                    control.locks.discard(path)
            if _native(lock):
                path.unlink(missing_ok=True)  # still held: nobody else can have replaced it
        lock.release()


@contextmanager
def lock_if_free(target: Path, *, record_holder: bool = False) -> Iterator[bool]:
    """Hold the lock of ``target`` when no other process holds it (yield True), else yield
    False at once; its file is removed on the way out, as :func:`build_lock` does. With
    ``record_holder`` the lock file records this process's id while held (:func:`lock_holder`)."""
    lock = process_lock(target)
    if not _try_acquire(lock, 0):
        yield False
        return
    first = lock.lock_counter == 1
    try:
        if first and record_holder:
            _record_holder(lock, lock_path(target))
        yield True
    finally:
        if first and _native(lock):
            lock_path(target).unlink(missing_ok=True)
        lock.release()


def holder_text(target: Path) -> str:
    """Who holds ``target``'s lock, for a refusal: ``pid N``, or that its pid is not recorded
    yet (the holder has just taken it)."""
    holder = lock_holder(target)
    return f"pid {holder}" if holder is not None else "its pid not recorded yet"


def lock_holder(target: Path) -> int | None:
    """The process id recorded in ``target``'s lock file, when that process is alive."""
    try:
        first = lock_path(target).read_text(encoding="ascii", errors="replace").split("\n", 1)[0]
        pid = int(first.strip())
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:  # alive, another user's
        pass
    return pid


def _try_acquire(lock: filelock.FileLock, timeout: float) -> bool:
    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout:
        return False
    return True


def _native(lock: filelock.FileLock) -> bool:
    """A kernel (flock) lock, whose file is ours to write and remove while held; filelock's
    soft fallback (file systems without flock) keeps its own marker there instead."""
    try:
        lock.pid  # noqa: B018 - the soft fallback's marker; a native lock has none
    except AttributeError:
        return True
    except Exception:  # an unreadable marker: leave it to filelock
        return False
    return False


def _record_holder(lock: filelock.FileLock, path: Path) -> None:
    if not _native(lock):
        return
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:
        pass
    finally:
        os.close(fd)
