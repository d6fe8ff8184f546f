"""Training jobs: `casi train` in its own process, its state in the database.

Read :class:`JobRunner`. `start` records a `train_jobs` row, then starts
``python -m app.cli train --preset P ... --name job-<id>`` in a new session (its own process
group, so `cancel` can stop the trainer and anything it spawned), stdout and stderr to
``var/jobs/job-<id>.log``. The run the trainer records in `training_runs` is found by that name.

**One state machine** for a job and its training run (:data:`TRANSITIONS`)::

    queued → running → finished | failed | cancelled      (queued → failed | cancelled too)

Every change is one conditional UPDATE (``WHERE status IN <states it may come from>``) that
also ends the job's run (``training_runs`` named ``job-<id>`` still `running`) in the SAME
transaction, so the job, its run and the API never disagree, and of two racing writers (a
cancel and the reaper) the first to commit wins: `cancel` commits `cancelled` BEFORE it signals
the process, so the reaper seeing the killed process cannot store `failed`. Cancel is
idempotent (a cancelled job is answered again; a finished or failed one is a 409). At most
``max_running`` jobs (training and audits) are queued or running at once: one more is a 409.
:meth:`JobRunner.admission` counts them and inserts the new job's queued row in ONE database
transaction under a database lock (PostgreSQL ``pg_advisory_xact_lock``, SQLite ``BEGIN
IMMEDIATE``), so two API processes on one database (``--workers N``, or several hosts on
PostgreSQL) cannot both take the last slot; before counting it reconciles every active job and
audit, so a dead one never holds a slot.

Audits (:mod:`app.workers.audit_jobs`) are cancelled by the same code: :func:`cancel_then_stop`
(the rules above) and :func:`app.workers.processes.stop_group` (SIGTERM to the process group,
then SIGKILL), on the same state machine (:data:`app.db.models.TRANSITIONS`).

Job state lives only in the database, so it survives an API restart. A `running` job whose
process is gone is *reconciled* whenever it is read (and by `reap`, every second): exit code
0 — or, when this API process is not its parent, a finished run — means `finished`; anything
else `failed`, with the reason. A pid is only trusted while ``/proc/<pid>/cmdline`` still names
the job (or the process is this API process's own child still starting: between fork and exec
it shows the parent's cmdline, inside execve an empty one), so a reused pid never keeps a dead
job "running".
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import (
    TRANSITIONS,
    AuditReport,
    JobStatus,
    RunStatus,
    TrainingRun,
    TrainJob,
    sources,
    utcnow,
)
from app.errors import InvalidField, JobConflict, UnknownRecord
from app.schemas_ops import EvaluationOut, TrainJobList, TrainJobOut, TrainJobRequest
from app.training.policy_loader import find_registered
from app.workers.processes import audit_process_alive, pid_runs, stop_group
from policy.config_tree import option_table
from policy.losses import available_presets
from policy.train_config import TrainConfig

QUEUED_GRACE_S = 60.0  # a job still without a process after this long was never started
ACTIVE = tuple(s.value for s in TRANSITIONS)  # queued, running: the states a job may leave
RUN_STATUS = {JobStatus.FINISHED: RunStatus.FINISHED, JobStatus.FAILED: RunStatus.FAILED,
              JobStatus.CANCELLED: RunStatus.CANCELLED}  # fmt: skip
AUDIT_ACTIVE = ACTIVE  # an audit's pending `verdict`: it holds a job slot
ADMISSION_LOCK = 0x43415349_4A4F4253  # "CASIJOBS": the PostgreSQL advisory lock of admission
RUN_FLAGS = {"evaluator": "--evaluator", "policy": "--policy", "max_docs": "--max-docs"}
"""`casi train` options of a job that are not training-config fields; the others are the
config's own flags (`TrainConfig.options()`: ``lr`` → ``--lr``, ``n_actions`` → ``--n-actions``)."""


JOB_FIELDS = tuple(name for name in TrainJobRequest.model_fields if name != "preset")
"""The options a training job may set (TrainJobRequest's fields, in its order)."""


def job_flag(field: str) -> str:
    """The `casi train` flag of a TrainJobRequest field."""
    opt = option_table(TrainConfig).get(field)
    return f"--{opt.flag}" if opt is not None else RUN_FLAGS[field]


def job_args(field: str, value: object) -> list[str]:
    """The `casi train` arguments of one field's value: ``--flag value``; booleans are
    ``--flag`` / ``--no-flag``, sequences repeat the flag once per item."""
    flag = job_flag(field)
    if isinstance(value, bool):
        return [flag if value else f"--no-{flag.removeprefix('--')}"]
    if isinstance(value, list | tuple):
        return [part for item in value for part in (flag, str(item))]
    return [flag, str(value)]


_UNMAPPED = [f for f in JOB_FIELDS if f not in RUN_FLAGS and f not in option_table(TrainConfig)]
if _UNMAPPED:  # a request field with no `casi train` option would fail every such job
    raise TypeError(f"TrainJobRequest fields without a casi train option: {_UNMAPPED}")


def run_name(job_id: int) -> str:
    return f"job-{job_id}"


def start_failure(exc: OSError) -> str:
    """A job's ``error`` when its process could not start: the OS's reason, never a path on
    this machine (any user-scope key reads it)."""
    return f"could not start: {exc.strerror or type(exc).__name__}"


def transition(session: Session, job_id: int, to: JobStatus, **fields: object) -> bool:
    """Move the job to ``to`` from a state allowed to reach it, and end its run with it, in
    the caller's transaction; False (nothing written) when another writer moved it first."""
    result = session.execute(
        update(TrainJob).where(TrainJob.id == job_id, TrainJob.status.in_(sources(to)))
        .values(status=to.value, **fields).execution_options(synchronize_session=False)
    )  # fmt: skip
    moved = cast(CursorResult[Any], result).rowcount
    if moved != 1:
        session.expire_all()
        return False
    end_run(session, job_id, to)
    session.expire_all()
    return True


def end_run(session: Session, job_id: int, status: JobStatus) -> None:
    """The job's run, if still `running`, takes the job's final status."""
    if status not in RUN_STATUS:
        return
    session.execute(
        update(TrainingRun)
        .where(TrainingRun.name == run_name(job_id), TrainingRun.status == RunStatus.RUNNING.value)
        .values(status=RUN_STATUS[status].value, finished_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def active_jobs(session: Session) -> int:
    """Training jobs and audits queued or running."""
    jobs = session.scalar(
        select(func.count()).select_from(TrainJob).where(TrainJob.status.in_(ACTIVE))
    )
    audits = session.scalar(
        select(func.count()).select_from(AuditReport).where(AuditReport.verdict.in_(AUDIT_ACTIVE))
    )
    return int(jobs or 0) + int(audits or 0)


def lock_admission(session: Session) -> None:
    """Take the database's admission lock for the rest of ``session``'s transaction (its first
    statement): PostgreSQL's transaction-level advisory lock; on SQLite ``BEGIN IMMEDIATE``
    (the database's write lock, taken now rather than at the first write, so the count that
    follows cannot be read by two writers at once; another waits up to its busy timeout).
    Other backends: none (the caller's thread lock only)."""
    backend = session.get_bind().dialect.name
    if backend == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(ADMISSION_LOCK)))
    elif backend == "sqlite":
        session.execute(text("BEGIN IMMEDIATE"))


def reconcile_audit(session: Session, row: AuditReport) -> None:
    """An audit as :meth:`JobRunner._reconciled` treats a training job, in the caller's
    transaction: `running` with its process gone → `failed`; `queued` with no process after
    :data:`QUEUED_GRACE_S` (the API died while starting it) → `failed` (a conditional UPDATE:
    a writer that moved it first wins)."""
    report = dict(row.report or {})
    pid = report.get("pid")
    if row.verdict == JobStatus.RUNNING.value and pid is not None:
        if audit_process_alive(int(pid), row.id):
            return
        error = "the audit process is gone without a report"
    elif row.verdict == JobStatus.QUEUED.value and pid is None:
        if (utcnow() - row.created_at).total_seconds() <= QUEUED_GRACE_S:
            return
        error = "never started"
    else:
        return
    failed = JobStatus.FAILED.value
    repo.move_audit_report(session, row.id, sources(JobStatus.FAILED), verdict=failed,
                           report={**report, "status": failed, "error": error})  # fmt: skip


def train_argv(job_id: int, preset: str, overrides: dict[str, object]) -> list[str]:
    """The command line of a job: values were validated by the schema, flags are fixed."""
    argv = [sys.executable, "-m", "app.cli", "train", "--preset", preset]
    for field, value in overrides.items():
        if value is not None:
            argv += job_args(field, value)
    return argv + ["--name", run_name(job_id)]


def process_alive(pid: int, job_id: int) -> bool:
    """Whether ``pid`` is still this job's process (not exited, not a zombie, not reused)."""
    return pid_runs(pid, lambda cmdline: run_name(job_id).encode() in cmdline)


def cancel_then_stop(
    what: str,
    read: Callable[[], tuple[str, int | None]],
    move: Callable[[], bool],
    stop: Callable[[int], None],
) -> None:
    """THE cancel of a job, training or audit. ``read()`` is its reconciled (status, pid);
    ``move()`` commits `cancelled` by a conditional UPDATE (False: another writer moved it
    first); ``stop(pid)`` ends its process group. `cancelled` is committed BEFORE the signal,
    so whoever sees the killed process cannot store `failed`. Idempotent: a cancelled job is
    left as it is; a job that ended otherwise (finished, failed) is a JobConflict (409)."""
    status, pid = read()
    if status != JobStatus.CANCELLED.value and (status not in ACTIVE or not move()):
        status, _ = read()  # moved meanwhile: by another cancel (fine) or to its end
        if status != JobStatus.CANCELLED.value:
            raise JobConflict(f"{what} is already {status}")
    if pid is not None:
        stop(pid)


class JobRunner:
    """Starts, cancels and reconciles training jobs; one per API process."""

    def __init__(self, factory: sessionmaker[Session], jobs_dir: Path) -> None:
        self.factory, self.jobs_dir = factory, Path(jobs_dir)
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # jobs THIS process started
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()  # the running-jobs cap: one start at a time

    @contextmanager
    def admission(self, max_running: int | None) -> Iterator[Session]:
        """Admit one job under the cap, training jobs AND audits counted: yields the session
        in which the caller inserts the job's queued row, committed on leaving. The count and
        that insert are one transaction under the database's admission lock
        (:func:`lock_admission`) and this process's thread lock, so two racing starts, in one
        API process or two, cannot both take the last slot. Every active job and audit is
        reconciled first (a dead one, or one queued too long, no longer holds a slot). Over
        the cap → JobConflict (409), nothing inserted."""
        with self._start_lock, session_scope(self.factory) as session:
            if max_running is not None:
                lock_admission(session)
                self._reconcile_active(session)
                if active_jobs(session) >= max_running:
                    raise JobConflict(
                        f"{max_running} jobs are already queued or running "
                        "(CASI_API_MAX_RUNNING_JOBS): wait for one to end, or cancel one"
                    )
            yield session

    def _reconcile_active(self, session: Session) -> None:
        """Reconcile every queued or running training job and audit (see the module)."""
        jobs = session.scalars(select(TrainJob).where(TrainJob.status.in_(ACTIVE))).all()
        for job in jobs:
            self._reconciled(session, job)
        audits = session.scalars(
            select(AuditReport).where(AuditReport.verdict.in_(AUDIT_ACTIVE))
        ).all()
        for row in audits:
            reconcile_audit(session, row)

    def start(
        self, req: TrainJobRequest, *, max_running: int | None = None,
        evaluators: Collection[str] | None = None,
    ) -> TrainJobOut:  # fmt: skip
        """Record the job and start its process. A preset the registry lacks, or an evaluator
        this server has not built (``evaluators``: its scorers; a surrogate not fitted), is
        an InvalidField (422), a policy no registered version matches an UnknownPolicy naming
        ``body.policy`` (404), all before anything is recorded (the trainer would fail on
        them seconds later); a version prefix is stored as the full version it names."""
        if req.preset not in available_presets():
            raise InvalidField(
                "body.preset", f"unknown preset {req.preset!r}; valid: {available_presets()}"
            )
        if evaluators is not None and req.evaluator is not None and req.evaluator not in evaluators:
            raise InvalidField(
                "body.evaluator",
                f"evaluator {req.evaluator!r} is not available on this server; available: "
                f"{sorted(evaluators)}",
            )
        if req.policy is not None:
            req = req.model_copy(update={"policy": find_registered(self.factory, req.policy)})
        overrides = req.model_dump(exclude={"preset"}, exclude_none=True)
        with self.admission(max_running) as session:
            job_id = repo.create_train_job(session, preset=req.preset, overrides=overrides).id
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.jobs_dir / f"{run_name(job_id)}.log"
        argv = train_argv(job_id, req.preset, overrides)
        try:
            with log_path.open("ab") as log:
                proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )  # fmt: skip
        except OSError as exc:
            return self._move(job_id, JobStatus.FAILED, error=start_failure(exc),
                              finished_at=utcnow(), log_path=str(log_path))  # fmt: skip
        with self._lock:
            self._children[job_id] = proc
        out = self._move(job_id, JobStatus.RUNNING, pid=proc.pid, log_path=str(log_path),
                         run_name=run_name(job_id), started_at=utcnow())  # fmt: skip
        if out.status == JobStatus.CANCELLED.value:  # cancelled while it started: stop it too
            self._stop_group(job_id, proc.pid)
        return out

    def cancel(self, job_id: int) -> TrainJobOut:
        """Mark the job and its run cancelled (committed first), then stop its process group
        (SIGTERM, then SIGKILL). Idempotent; a finished or failed job is a JobConflict."""

        def read() -> tuple[str, int | None]:
            with session_scope(self.factory) as session:
                job = self._reconciled(session, self._get(session, job_id))
                return job.status, job.pid

        def move() -> bool:
            with session_scope(self.factory) as session:
                return transition(session, job_id, JobStatus.CANCELLED, finished_at=utcnow(),
                                  error="cancelled by request")  # fmt: skip

        cancel_then_stop(f"job {job_id}", read, move, lambda pid: self._stop_group(job_id, pid))
        with session_scope(self.factory) as session:
            end_run(session, job_id, JobStatus.CANCELLED)  # a run registered meanwhile
            return self._out(session, self._get(session, job_id))

    def _stop_group(self, job_id: int, pid: int) -> None:
        if not process_alive(pid, job_id):
            return

        def ended() -> bool:
            with self._lock:
                child = self._children.get(job_id)
            exited = child is not None and child.poll() is not None
            return exited or not process_alive(pid, job_id)

        stop_group(pid, ended)
        with self._lock:
            child = self._children.pop(job_id, None)
        if child is not None:
            child.wait(timeout=5)

    def get(self, job_id: int) -> TrainJobOut:
        with session_scope(self.factory) as session:
            return self._out(session, self._reconciled(session, self._get(session, job_id)))

    def list_jobs(self, *, limit: int, offset: int, status: str | None) -> TrainJobList:
        with session_scope(self.factory) as session:
            jobs = repo.list_train_jobs(session, limit=limit, offset=offset, status=status)
            return TrainJobList(
                items=[self._out(session, self._reconciled(session, j)) for j in jobs]
            )

    def reap(self) -> None:
        """Record the exit of every child that ended (called every second by the lifespan)."""
        with self._lock:
            ended = [job_id for job_id, p in self._children.items() if p.poll() is not None]
        for job_id in ended:
            with session_scope(self.factory) as session:
                self._reconciled(session, self._get(session, job_id))

    def close(self) -> None:
        """Forget the children (they keep running: a job survives an API restart)."""
        with self._lock:
            self._children.clear()

    # --- helpers ----------------------------------------------------------------------

    def _get(self, session: Session, job_id: int) -> TrainJob:
        job = repo.get_train_job(session, job_id)
        if job is None:
            raise UnknownRecord(f"no training job {job_id}", "path.job_id")
        return job

    def _move(self, job_id: int, to: JobStatus, **fields: object) -> TrainJobOut:
        """A transition; when another writer got there first (a cancel during start), the
        job as that writer left it."""
        with session_scope(self.factory) as session:
            transition(session, job_id, to, **fields)
            return self._out(session, self._get(session, job_id))

    def _reconciled(self, session: Session, job: TrainJob) -> TrainJob:
        """A `running` job whose process is gone becomes `finished` or `failed` (see module);
        a `queued` job that never got a process (the API died while starting it) `failed`."""
        if job.status == JobStatus.QUEUED.value and job.pid is None:
            if (utcnow() - job.created_at).total_seconds() > QUEUED_GRACE_S:
                transition(session, job.id, JobStatus.FAILED, error="never started",
                           finished_at=utcnow())  # fmt: skip
                return self._get(session, job.id)
            return job
        if job.status != JobStatus.RUNNING.value or job.pid is None:
            return job
        with self._lock:
            child = self._children.get(job.id)
        code = child.poll() if child is not None else None
        if child is None and process_alive(job.pid, job.id):
            return job
        if child is not None and code is None:
            return job
        with self._lock:
            self._children.pop(job.id, None)
        run = repo.latest_run_by_name(session, job.run_name or "")
        finished = code == 0 or (
            code is None and run is not None and run.status == RunStatus.FINISHED.value
        )
        error = None if finished else (  # the log's name, never its path on this machine
            f"the trainer exited with code {code}; see its log, {run_name(job.id)}.log in the "
            "server's jobs folder" if code is not None
            else "the trainer process is gone and its run did not finish (killed, or the machine restarted)"
        )  # fmt: skip
        job_id = job.id
        transition(session, job_id, JobStatus.FINISHED if finished else JobStatus.FAILED,
                   exit_code=code, error=error, finished_at=utcnow())  # fmt: skip
        return self._get(session, job_id)

    def _out(self, session: Session, job: TrainJob) -> TrainJobOut:
        run = repo.latest_run_by_name(session, job.run_name) if job.run_name else None
        last = repo.latest_step_metric(session, run.id) if run is not None else None
        evals = repo.evaluations_for_run(session, run.id) if run is not None else []
        return TrainJobOut(
            id=job.id, status=job.status, preset=job.preset, overrides=dict(job.overrides), pid=job.pid,
            run_name=job.run_name, run_id=run.id if run else None,
            step=last.step if last else None, latest_metrics=dict(last.metrics) if last else None,
            evaluations=[EvaluationOut(step=e.step, split=e.split, metrics=dict(e.metrics)) for e in evals],
            created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
            exit_code=job.exit_code, error=job.error,
        )  # fmt: skip
