"""Write a folder atomically: the model folders CASI writes (a converted model, a checkpoint,
an imported policy, a trainer's resume state) are written whole or not at all.

Read `atomic_save` first: ``write(tmp)`` fills a temporary sibling of the target, a manifest
(sizes + sha256, `evaluator.artifacts.write_manifest`) is added and the folder is renamed onto
the target; its temporary folder goes on every way out, a SIGTERM included. A folder that a
killed process left behind (its name holds that process's id and host) is removed by the next
save of the same target (`remove_stale_temps`). Reading such a folder back and refusing it
when damaged is `policy.model.check_model_folder`.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from evaluator.artifacts import make_temp_dir, remove_temp_dir, replace_dir, write_manifest

log = logging.getLogger(__name__)

TMP_MARKER = ".tmp-"  # `.<target>.tmp-<pid>.<host>.<random>`: atomic_save's folder in progress


def atomic_save(target: Path, write: Any, *, exclusive: bool = False) -> Path:
    """Call ``write(tmp_dir)``, add a manifest (sizes + sha256), rename tmp_dir onto ``target``
    (an existing folder there is replaced): a crash never leaves a half-written model.

    The temporary folder is removed on every way out: an error, KeyboardInterrupt, a SIGTERM
    (while it would kill the process outright, it raises SystemExit(143) here instead, so the
    folder goes on the way out), and, in a thread whose work is controlled
    (`evaluator.work_control.controlled`: the API's start-up), by the caller that abandons it. One a killed process left behind (SIGKILL, power loss) is
    removed by the next save of ``target`` (:func:`remove_stale_temps`): its name holds the
    process id and host that wrote it. ``exclusive``: the caller holds ``target``'s build lock,
    so no other process is writing it and every leftover folder of ``target`` is stale."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target, exclusive=exclusive)
    with _sigterm_raises():
        tmp = make_temp_dir(target.parent, _tmp_prefix(target) + _owner_tag())
        try:
            write(tmp)
            write_manifest(tmp)
            replace_dir(tmp, target)
        finally:
            remove_temp_dir(tmp)
    return target


def remove_stale_temps(target: Path, *, exclusive: bool = False) -> list[Path]:
    """Remove the temporary folders of ``target`` that interrupted saves left behind: those
    whose process is gone (same host; a process id alive, or of another host, is left alone),
    or, with ``exclusive`` (the caller holds the build lock of ``target``), all of them and the
    ``.<target>.old-*`` folders a replacement set aside. Returns the folders removed."""
    removed = []
    prefixes = [_tmp_prefix(target)] + ([f".{target.name}.old-"] if exclusive else [])
    for prefix in prefixes:
        for folder in sorted(target.parent.glob(glob.escape(prefix) + "*")):
            if folder.is_symlink() or not folder.is_dir():
                continue
            if exclusive or _owner_gone(folder.name[len(prefix) :]):
                shutil.rmtree(folder, ignore_errors=True)
                log.info("removed %s, left by an interrupted save", folder)
                removed.append(folder)
    return removed


def _tmp_prefix(target: Path) -> str:
    return f".{target.name}{TMP_MARKER}"


def _host_tag() -> str:
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def _owner_tag() -> str:
    return f"{os.getpid()}.{_host_tag()}."


def _owner_gone(rest: str) -> bool:
    """Whether the process named in a temporary folder's name (``<pid>.<host>.<random>``) is
    gone. Unknown (an older name without owner, another host): False, the folder is kept."""
    pid, _, tail = rest.partition(".")
    host = tail.partition(".")[0]
    if not pid.isdigit() or host != _host_tag():
        return False
    if int(pid) == os.getpid():
        return False  # this process: maybe another thread's save in progress
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's)
        return False
    return False


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While a save runs, a SIGTERM that would kill the process outright (no handler of its
    own, main thread) raises SystemExit(128 + 15) instead, so ``finally`` clauses run."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def _exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
