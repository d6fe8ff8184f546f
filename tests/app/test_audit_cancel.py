"""Issue 27, item 4: an audit job could not be cancelled (no `POST /v1/audits/{id}/cancel`, no
button), so a 50-minute audit held a job slot to its end. Audits now move by the training jobs'
state machine and are cancelled by the same code (`app.workers.jobs.cancel_then_stop` and
`stop_group`): `cancelled` is committed first, then the process group ends (a grandchild too),
the slot is free, nobody can overwrite the state afterwards (not the watcher that sees the
killed process, not the audit process storing its report), and a second cancel is a no-op.
Real databases (SQLite, and PostgreSQL when reachable), real processes; no audit runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.db import repositories as repo
from app.db import session_scope
from app.db.session import make_session_factory
from app.errors import JobConflict
from app.services import audit as service
from app.workers import audit_jobs, audit_records, jobs, processes

REQUEST = service.AuditRequest(evaluators=("cosine",), from_run=1)
# A stand-in for `casi audit run ... --into ID`: the same markers on its command line (what
# `audit_jobs.process_alive` trusts), and a grandchild in its process group.
GROUP = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen(['sleep', '300'])\n"
    "open(sys.argv[1], 'w').write(str(child.pid))\n"
    "time.sleep(300)\n"
)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _ends(pid: int, within_s: float = 10.0) -> bool:
    """Whether ``pid`` is gone within ``within_s``: a signalled process dies when it is next
    scheduled, which on a loaded machine is not at once."""
    deadline = time.monotonic() + within_s
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _gone(pid)


def _running_audit(factory: Any, tmp_path: Path) -> tuple[int, subprocess.Popen[bytes], int]:
    """A queued row moved to running with a live process group → (id, process, grandchild)."""
    audit_id = service.create_pending(factory, REQUEST)
    pid_file = tmp_path / f"grandchild-{audit_id}"
    proc = subprocess.Popen(
        [sys.executable, "-c", GROUP, str(pid_file), "--into", str(audit_id)],
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.set_status(factory, audit_id, "running", pid=proc.pid)
    assert audit_jobs.process_alive(proc.pid, audit_id)
    return audit_id, proc, int(pid_file.read_text())


def _active(factory: Any) -> int:
    with session_scope(factory) as session:
        return jobs.active_jobs(session)


def test_a_running_audit_is_cancelled_like_a_training_job(
    db_engine: Engine, tmp_path: Path
) -> None:
    factory = make_session_factory(db_engine)
    audit_id, proc, grandchild = _running_audit(factory, tmp_path)
    try:
        assert _active(factory) == 1  # it holds a job slot
        audit_jobs.cancel(factory, audit_id)
        proc.wait(timeout=processes.CANCEL_GRACE_S + 5)
        assert _gone(proc.pid) and _ends(grandchild)  # the whole process group ended
        found = service.get_audit(factory, audit_id)
        assert found is not None
        assert found["status"] == "cancelled" and found["verdict"] == "cancelled"
        assert found["report"]["error"] == "cancelled by request"
        assert found["report"]["finished_at"]
        assert found["report"]["request"]["from_run"] == 1  # the request is kept
        assert _active(factory) == 0  # the slot is free

        audit_jobs.cancel(factory, audit_id)  # idempotent: still cancelled, no error
        # the watcher that sees the killed process cannot store `failed` ...
        assert not service.set_status(factory, audit_id, "failed", error="exit -15")
        # ... and an audit process that got as far as its report cannot store it
        report = {"train_evaluator": {"name": "cosine"}, "reference_evaluator": {"name": "replay"},
                  "n_rollouts": 4, "verdict": "agrees"}  # fmt: skip
        with pytest.raises(JobConflict, match=f"audit {audit_id} is cancelled"):
            service._store(factory, report, tmp_path, audit_id)
        assert not list(tmp_path.glob("audit-*.json"))
        after = service.get_audit(factory, audit_id)
        assert after is not None and after["status"] == "cancelled"
    finally:
        for pid in (proc.pid, grandchild):
            if not _gone(pid):
                os.kill(pid, 9)
        proc.wait(timeout=5)


def test_a_queued_audit_is_cancelled_and_its_late_start_is_refused(db_engine: Engine) -> None:
    factory = make_session_factory(db_engine)
    audit_id = service.create_pending(factory, REQUEST)
    audit_jobs.cancel(factory, audit_id)  # no process yet: only the state moves
    assert not service.set_status(factory, audit_id, "running", pid=os.getpid())
    found = service.get_audit(factory, audit_id)
    assert found is not None and found["status"] == "cancelled" and "pid" not in found["report"]


def test_an_ended_or_unknown_audit_cannot_be_cancelled(db_engine: Engine) -> None:
    factory = make_session_factory(db_engine)
    failed = service.create_pending(factory, REQUEST)
    assert service.set_status(factory, failed, "failed", error="boom")
    with pytest.raises(JobConflict, match=f"audit {failed} is already failed"):
        audit_jobs.cancel(factory, failed)
    finished = service.create_pending(factory, REQUEST)
    report = {"train_evaluator": {"name": "cosine"}, "reference_evaluator": {"name": "replay"},
              "n_rollouts": 4, "verdict": "agrees", "schema_version": 1}  # fmt: skip
    with session_scope(factory) as session:  # what the audit process stores when it finishes
        assert repo.move_audit_report(
            session, finished, service.PENDING, report=report, verdict="agrees", n_rollouts=4
        )
    with pytest.raises(JobConflict, match=f"audit {finished} is already finished"):
        audit_jobs.cancel(factory, finished)
    with pytest.raises(LookupError, match="no audit 999999"):
        audit_jobs.cancel(factory, 999_999)
    statuses = [service.get_audit(factory, i)["status"] for i in (failed, finished)]  # type: ignore[index]
    assert statuses == ["failed", "finished"]


def test_training_jobs_and_audits_share_one_cancel() -> None:
    """One implementation: the audit's cancel is the jobs' (not a copy of it)."""
    assert audit_jobs.cancel_then_stop is jobs.cancel_then_stop
    assert audit_jobs.stop_group is jobs.stop_group
    assert audit_records.sources is jobs.sources  # the same state machine for both


def test_a_job_is_alive_from_its_start_not_from_its_exec() -> None:
    """CI saw a just-started audit read back as failed: between fork and exec a child's
    /proc/<pid>/cmdline is still its parent's (the API's), which names no job. Such a child (a
    fork that has not exec'd) is alive; an exec'd process must name the job, child or not; a
    reaped child is gone."""
    forked = os.fork()
    if forked == 0:  # the child: never exec'd, so its cmdline is this test process's
        time.sleep(30)
        os._exit(0)
    try:
        assert audit_jobs.process_alive(forked, 7) and jobs.process_alive(forked, 7)
    finally:
        os.kill(forked, 9)
        os.waitpid(forked, 0)
    assert not audit_jobs.process_alive(forked, 7) and not jobs.process_alive(forked, 7)
    other = subprocess.Popen(["sleep", "30"])  # exec'd, a child, naming neither job nor audit
    named = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--into", "7"])
    # another audit whose other arguments hold "4" (a reused pid must not keep audit 4 alive)
    reused = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", "--into", "9", "--queries", "4"]
    )
    try:
        assert not audit_jobs.process_alive(other.pid, 7) and not jobs.process_alive(other.pid, 7)
        assert audit_jobs.process_alive(named.pid, 7) and not audit_jobs.process_alive(named.pid, 8)
        assert audit_jobs.process_alive(reused.pid, 9) and not audit_jobs.process_alive(
            reused.pid, 4
        )
    finally:
        for proc in (other, named, reused):
            proc.kill()
            proc.wait()


def test_a_job_is_alive_while_it_execs() -> None:
    """CI saw it again with the fork case covered: `subprocess.Popen` returns while the child is
    inside execve, whose /proc/<pid>/cmdline reads empty until the new program's arguments are
    in place (a read right after Popen saw that in most starts on a 2-core machine, a read after
    /proc/<pid>/stat in a few percent). A job or an audit read at once, as POST /v1/audits
    does, is alive; once started, it names itself."""
    argv = [sys.executable, "-c", "import time; time.sleep(30)", "--into", "7", "job-7"]
    for _ in range(300):  # the window is some microseconds: most starts here miss it
        proc = subprocess.Popen(argv)
        try:
            assert audit_jobs.process_alive(proc.pid, 7) and jobs.process_alive(proc.pid, 7)
        finally:
            proc.kill()
            proc.wait()
        assert not audit_jobs.process_alive(proc.pid, 7) and not jobs.process_alive(proc.pid, 7)
