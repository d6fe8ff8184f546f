"""Which process is which, and ending one: the process identity the job runners trust
(:func:`pid_runs`: alive, not a zombie, still naming its job or audit, so a reused pid never
keeps a dead job "running"; or this process's own child still starting) and the end of a
process group (:func:`stop_group`: SIGTERM, a grace, SIGKILL). Used by `app.workers.jobs`
(training jobs) and `app.workers.audit_jobs` (audits)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

CANCEL_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long


def audit_process_alive(pid: int, audit_id: int) -> bool:
    """Whether ``pid`` is still this audit's process (``casi audit run ... --into <id>``; a
    child of this process that has not exec'd yet counts: :func:`pid_runs`)."""
    into = [b"--into", str(audit_id).encode()]  # the id right after --into, not anywhere

    def names_it(cmdline: list[bytes]) -> bool:
        return any(cmdline[i : i + 2] == into for i in range(len(cmdline) - 1))

    return pid_runs(pid, names_it)


EXECING = [b""]
"""The cmdline of a process inside execve: once the new program's memory replaces the old,
and until its arguments are copied in, /proc/<pid>/cmdline reads empty. `subprocess.Popen`
returns in that window (its close-on-exec pipe closes before the arguments are placed), and a
read right after it saw this in 382 of 400 starts here."""


def pid_runs(pid: int, names_it: Callable[[list[bytes]], bool]) -> bool:
    """Whether process ``pid`` runs and is the one meant: ``names_it(its cmdline arguments)``,
    or it is this process's own child still starting: between fork and exec (its cmdline is
    still this process's) or inside execve (empty, :data:`EXECING`). Either way a read right
    after the start would take a starting job for a dead one. Without /proc (macOS):
    existence only."""
    proc = Path(f"/proc/{pid}")
    if Path("/proc/self").exists():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            state, parent = fields[0], int(fields[1])
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            return False
        if state in ("Z", "X"):
            return False
        if names_it(cmdline):
            return True
        if parent != os.getpid():
            return False
        own = Path("/proc/self/cmdline").read_bytes().split(b"\0")
        return cmdline in (own, EXECING)  # forked and not yet exec'd, or inside its execve
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def stop_group(pid: int, ended: Callable[[], bool], grace_s: float = CANCEL_GRACE_S) -> None:
    """End the process group ``pid`` leads: SIGTERM, up to ``grace_s`` for ``ended()``, then
    SIGKILL to anything left in the group (training jobs and audits alike)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not ended():
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)  # anything left in the group
    except ProcessLookupError:
        pass
