"""Audit jobs for the API: ``casi audit run ... --into ID`` in its own process, state in the
``audit_reports`` row. Read :func:`start`.

`start` stores a queued row (its report holds the request), starts
``python -m app.cli audit run ... --into <id>`` in a new session (its own process group),
output to ``var/jobs/audit-<id>.log``, records ``running`` + pid, and leaves a daemon thread
waiting for the process. The process fills the row (report, verdict, HTML) or marks it failed
with the reason; a process that exits without doing either — or that is gone when a row is
read after an API restart — is marked failed by :func:`reconcile`. The audit itself is the
same service function the CLI calls (:func:`app.services.audit.run_audit`).

The row's status follows the training jobs' state machine (:data:`app.db.models.TRANSITIONS`,
conditional UPDATEs in :func:`app.workers.audit_records.set_status`), and :func:`cancel` is the jobs'
cancel (:func:`app.workers.jobs.cancel_then_stop`, :func:`app.workers.processes.stop_group`):
`cancelled` is committed, then the process group gets SIGTERM, then SIGKILL; the slot it held
under ``CASI_API_MAX_RUNNING_JOBS`` is free at once.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from contextlib import AbstractContextManager
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import utcnow
from app.errors import UnknownRecord
from app.workers.audit_records import AuditRequest, add_pending, get_audit, set_status
from app.workers.jobs import cancel_then_stop, reconcile_audit, start_failure
from app.workers.processes import audit_process_alive, stop_group

FLAGS = {  # AuditRequest field → `casi audit run` option (values validated by AuditRequest)
    "reference": "--reference", "policy": "--policy", "split": "--split", "queries": "--queries",
    "samples": "--samples", "n_actions": "--n-actions", "from_run": "--from-run", "seed": "--seed",
    "temperature": "--temperature", "max_new_tokens": "--max-new-tokens", "tol": "--tol",
    "threshold": "--threshold", "n_boot": "--n-boot", "batch_queries": "--batch-queries",
    "format": "--format", "line_cap": "--line-cap",
}  # fmt: skip


def job_name(audit_id: int) -> str:
    return f"audit-{audit_id}"


def audit_argv(audit_id: int, request: AuditRequest) -> list[str]:
    """The job's command line: fixed flags, values from the validated request."""
    argv = [sys.executable, "-m", "app.cli", "audit", "run"]
    for name in request.evaluators:
        argv += ["--evaluator", name]
    for name, flag in FLAGS.items():
        value = getattr(request, name)
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--anchor" if request.anchor_query else "--no-anchor"]
    return argv + ["--into", str(audit_id)]


def start(
    factory: sessionmaker[Session], request: AuditRequest, jobs_dir: Path,
    admission: AbstractContextManager[Session] | None = None,
) -> int:  # fmt: skip
    """Queue the audit — inside ``admission`` (`JobRunner.admission`: the running-jobs cap,
    the count and this insert one transaction) when given —, start its process, return the
    audit id."""
    with admission if admission is not None else session_scope(factory) as session:
        audit_id = add_pending(session, request)
    jobs_dir.mkdir(parents=True, exist_ok=True)
    log_path = jobs_dir / f"{job_name(audit_id)}.log"
    try:
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                audit_argv(audit_id, request), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
    except OSError as exc:
        set_status(factory, audit_id, "failed", error=start_failure(exc))
        return audit_id
    if not set_status(factory, audit_id, "running", pid=proc.pid, log_path=str(log_path)):
        stop_group(proc.pid, lambda: proc.poll() is not None)  # cancelled while it started
    threading.Thread(target=_watch, args=(factory, audit_id, proc), daemon=True).start()
    return audit_id


def _watch(factory: sessionmaker[Session], audit_id: int, proc: subprocess.Popen[bytes]) -> None:
    code = proc.wait()
    set_status(factory, audit_id, "failed", exit_code=code,
                    error=f"the audit process exited with code {code} without a report (see its log)")  # fmt: skip


def process_alive(pid: int, audit_id: int) -> bool:
    """Whether ``pid`` is still this audit's process (:func:`app.workers.processes.audit_process_alive`)."""
    return audit_process_alive(pid, audit_id)


def reconcile(factory: sessionmaker[Session], audit_id: int) -> None:
    """A running row whose process is gone (e.g. across an API restart), or a queued one that
    never got a process, becomes failed (:func:`app.workers.jobs.reconcile_audit`)."""
    with session_scope(factory) as session:
        row = repo.get_audit_report(session, audit_id)
        if row is not None:
            reconcile_audit(session, row)


def cancel(factory: sessionmaker[Session], audit_id: int) -> None:
    """Cancel an audit job exactly as a training job (:func:`app.workers.jobs.cancel_then_stop`):
    `cancelled` committed first, then its process group stopped. Idempotent; a finished or
    failed audit is a JobConflict (409); an unknown id a LookupError (404)."""

    def read() -> tuple[str, int | None]:
        reconcile(factory, audit_id)
        found = get_audit(factory, audit_id)
        if found is None:
            raise UnknownRecord(f"no audit {audit_id}", "path.audit_id")
        pid = found["report"].get("pid")
        return str(found["status"]), int(pid) if pid is not None else None

    def move() -> bool:
        return set_status(factory, audit_id, "cancelled", error="cancelled by request",
                          finished_at=utcnow().isoformat())  # fmt: skip

    def stop(pid: int) -> None:
        if process_alive(pid, audit_id):
            stop_group(pid, lambda: not process_alive(pid, audit_id))

    cancel_then_stop(f"audit {audit_id}", read, move, stop)
