"""Repositories: small functions that read and write models through a given Session.

They `flush` (so ids and constraint errors appear at the call) but never `commit`: the
service calling them owns the one transaction (`app.db.session.session_scope`). API keys
are stored as sha256 only; read `generate_api_key` and `verify_api_key` for that path.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, delete, select, update
from sqlalchemy.orm import Session

from app.db.models import (
    ApiKey,
    AuditReport,
    CreditRecord,
    Evaluation,
    JobStatus,
    PolicyKind,
    PolicyVersion,
    RunStatus,
    StepMetric,
    TrainingRun,
    TrainJob,
    utcnow,
)

API_KEY_PREFIX = "casi_"  # recognisable in logs and secret scanners
API_KEY_RANDOM_BYTES = 32  # 256 bits: a plain (unsalted) sha256 is then safe to store
API_KEY_DISPLAY_CHARS = 8


# --- policy versions ------------------------------------------------------------------


def add_policy_version(
    session: Session,
    *,
    version: str,
    name: str,
    base_model: str,
    path: str,
    kind: PolicyKind | str,
    step: int = 0,
    parent_id: int | None = None,
    meta: Mapping[str, Any] | None = None,
) -> PolicyVersion:
    """Register a checkpoint. A duplicate `version` raises IntegrityError at flush."""
    row = PolicyVersion(
        version=version,
        name=name,
        base_model=base_model,
        path=path,
        kind=PolicyKind(kind).value,
        step=step,
        parent_id=parent_id,
        meta=dict(meta or {}),
    )
    session.add(row)
    session.flush()
    return row


def get_policy_version_by_version(session: Session, version: str) -> PolicyVersion | None:
    return session.scalars(select(PolicyVersion).where(PolicyVersion.version == version)).first()


def latest_policy_version(
    session: Session, *, kind: PolicyKind | str | None = None
) -> PolicyVersion | None:
    """The most recently registered version (optionally of one kind)."""
    query = select(PolicyVersion)
    if kind is not None:
        query = query.where(PolicyVersion.kind == PolicyKind(kind).value)
    query = query.order_by(PolicyVersion.created_at.desc(), PolicyVersion.id.desc())
    return session.scalars(query.limit(1)).first()


# --- training runs and step metrics ---------------------------------------------------


def create_run(
    session: Session,
    *,
    name: str,
    preset: str,
    config: Mapping[str, Any],
    policy_version_id: int | None = None,
    notes: str | None = None,
) -> TrainingRun:
    run = TrainingRun(
        name=name,
        preset=preset,
        config=dict(config),
        status=RunStatus.RUNNING.value,
        policy_version_id=policy_version_id,
        notes=notes,
    )
    session.add(run)
    session.flush()
    return run


def finish_run(
    session: Session,
    run_id: int,
    *,
    status: RunStatus | str = RunStatus.FINISHED,
    notes: str | None = None,
    finished_at: datetime | None = None,
) -> TrainingRun:
    """Mark a run finished or failed. Unknown `run_id` raises LookupError."""
    status = RunStatus(status)
    if status is RunStatus.RUNNING:
        raise ValueError("finish_run needs status 'finished' or 'failed', not 'running'")
    run = session.get(TrainingRun, run_id)
    if run is None:
        raise LookupError(f"no training run with id {run_id}")
    run.status = status.value
    run.finished_at = finished_at or utcnow()
    if notes is not None:
        run.notes = notes
    session.flush()
    return run


def add_step_metrics(
    session: Session,
    run_id: int,
    step: int,
    metrics: Mapping[str, float],
    *,
    accepted: bool | None = None,
) -> StepMetric:
    """Store one step's scalars (cast to float here). A repeated (run, step) raises."""
    row = StepMetric(
        run_id=run_id,
        step=step,
        metrics={str(k): float(v) for k, v in metrics.items()},
        accepted=accepted,
    )
    session.add(row)
    session.flush()
    return row


def step_metrics_for_run(session: Session, run_id: int) -> list[StepMetric]:
    query = select(StepMetric).where(StepMetric.run_id == run_id).order_by(StepMetric.step)
    return list(session.scalars(query))


# --- credit records and audits --------------------------------------------------------


def add_credit_records(
    session: Session, records: Sequence[Mapping[str, Any]]
) -> list[CreditRecord]:
    """Insert many credit records (keys are CreditRecord column names; unknown keys raise)."""
    rows = [CreditRecord(**dict(record)) for record in records]
    session.add_all(rows)
    session.flush()
    return rows


def credit_records_for_run(
    session: Session, run_id: int, *, step: int | None = None
) -> list[CreditRecord]:
    """A run's credit records (optionally one step), by step, query, sample."""
    query = select(CreditRecord).where(CreditRecord.run_id == run_id)
    if step is not None:
        query = query.where(CreditRecord.step == step)
    query = query.order_by(
        CreditRecord.step, CreditRecord.query_id, CreditRecord.sample_index, CreditRecord.id
    )
    return list(session.scalars(query))


def add_audit_report(
    session: Session,
    *,
    train_evaluator: str,
    reference_evaluator: str,
    n_rollouts: int,
    report: Mapping[str, Any],
    verdict: str,
    html_path: str | None = None,
) -> AuditReport:
    row = AuditReport(
        train_evaluator=train_evaluator,
        reference_evaluator=reference_evaluator,
        n_rollouts=n_rollouts,
        report=dict(report),
        verdict=verdict,
        html_path=html_path,
    )
    session.add(row)
    session.flush()
    return row


# --- API keys -------------------------------------------------------------------------


def hash_api_key(plaintext: str) -> str:
    """sha256 hex of the key: what is stored and looked up."""
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def generate_api_key() -> tuple[str, str, str]:
    """A fresh key as (plaintext, sha256 hex, display prefix). Show the plaintext once."""
    plaintext = API_KEY_PREFIX + secrets.token_urlsafe(API_KEY_RANDOM_BYTES)
    return plaintext, hash_api_key(plaintext), plaintext[:API_KEY_DISPLAY_CHARS]


def create_api_key(session: Session, name: str, *, scope: str = "user") -> str:
    """Store a new key's hash under `name` with `scope`; return the plaintext (never stored)."""
    plaintext, key_hash, prefix = generate_api_key()
    session.add(ApiKey(name=name, key_hash=key_hash, prefix=prefix, scope=scope))
    session.flush()
    return plaintext


def verify_api_key(session: Session, plaintext: str) -> ApiKey | None:
    """The active key matching `plaintext`, or None (unknown or revoked)."""
    query = select(ApiKey).where(
        ApiKey.key_hash == hash_api_key(plaintext), ApiKey.revoked_at.is_(None)
    )
    return session.scalars(query).first()


def revoke_api_key(session: Session, key_id: int) -> ApiKey:
    """Revoke a key (idempotent: the first revocation time is kept)."""
    key = session.get(ApiKey, key_id)
    if key is None:
        raise LookupError(f"no API key with id {key_id}")
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    return key


# --- training runs: resume, checkpoints, held-out evaluations --------------------------


def list_runs(session: Session, *, limit: int) -> list[TrainingRun]:
    """Newest first."""
    return list(session.scalars(select(TrainingRun).order_by(TrainingRun.id.desc()).limit(limit)))


def get_run(session: Session, run_id: int) -> TrainingRun | None:
    return session.get(TrainingRun, run_id)


def get_or_add_policy_version(session: Session, *, version: str, **fields: Any) -> PolicyVersion:
    """The registered row of ``version``, or a new one (re-registering is idempotent)."""
    return get_policy_version_by_version(session, version) or add_policy_version(
        session, version=version, **fields
    )


def add_evaluation(
    session: Session,
    *,
    policy_version_id: int,
    split: str,
    n_queries: int,
    metrics: Mapping[str, float],
    config: Mapping[str, Any] | None = None,
    run_id: int | None = None,
    step: int | None = None,
) -> Evaluation:
    row = Evaluation(
        policy_version_id=policy_version_id,
        run_id=run_id,
        step=step,
        split=split,
        n_queries=n_queries,
        metrics={str(k): float(v) for k, v in metrics.items()},
        config=dict(config or {}),
    )
    session.add(row)
    session.flush()
    return row


def evaluations_for_run(session: Session, run_id: int) -> list[Evaluation]:
    query = (
        select(Evaluation)
        .where(Evaluation.run_id == run_id)
        .order_by(Evaluation.step, Evaluation.id)
    )
    return list(session.scalars(query))


def evaluations_for_policy(session: Session, policy_version_id: int) -> list[Evaluation]:
    query = (
        select(Evaluation)
        .where(Evaluation.policy_version_id == policy_version_id)
        .order_by(Evaluation.id)
    )
    return list(session.scalars(query))


def truncate_run_after(session: Session, run_id: int, step: int) -> None:
    """Delete a run's step metrics, credit records and evaluations after ``step`` (resume)."""
    for model in (StepMetric, CreditRecord, Evaluation):
        session.execute(delete(model).where(model.run_id == run_id, model.step > step))
    session.flush()


# --- REST API: keys, policies, credit records, training jobs ---------------------------


def list_api_keys(session: Session) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).order_by(ApiKey.id)))


def list_policy_versions(session: Session, *, limit: int, offset: int = 0) -> list[PolicyVersion]:
    """Newest first."""
    query = select(PolicyVersion).order_by(PolicyVersion.created_at.desc(), PolicyVersion.id.desc())
    return list(session.scalars(query.limit(limit).offset(offset)))


def get_credit_record(session: Session, record_id: int) -> CreditRecord | None:
    return session.get(CreditRecord, record_id)


def create_train_job(session: Session, *, preset: str, overrides: Mapping[str, Any]) -> TrainJob:
    job = TrainJob(preset=preset, overrides=dict(overrides), status=JobStatus.QUEUED.value)
    session.add(job)
    session.flush()
    return job


def get_train_job(session: Session, job_id: int) -> TrainJob | None:
    return session.get(TrainJob, job_id)


def list_train_jobs(
    session: Session, *, limit: int, offset: int = 0, status: str | None = None
) -> list[TrainJob]:
    """Newest first, optionally of one status."""
    query = select(TrainJob)
    if status is not None:
        query = query.where(TrainJob.status == JobStatus(status).value)
    return list(session.scalars(query.order_by(TrainJob.id.desc()).limit(limit).offset(offset)))


def update_train_job(session: Session, job: TrainJob, **fields: Any) -> TrainJob:
    """Set columns of a job (status validated) and flush."""
    if "status" in fields:
        fields["status"] = JobStatus(fields["status"]).value
    for key, value in fields.items():
        if not hasattr(TrainJob, key):
            raise AttributeError(f"TrainJob has no column {key!r}")
        setattr(job, key, value)
    session.flush()
    return job


def latest_run_by_name(session: Session, name: str) -> TrainingRun | None:
    query = select(TrainingRun).where(TrainingRun.name == name).order_by(TrainingRun.id.desc())
    return session.scalars(query.limit(1)).first()


def latest_step_metric(session: Session, run_id: int) -> StepMetric | None:
    query = select(StepMetric).where(StepMetric.run_id == run_id).order_by(StepMetric.step.desc())
    return session.scalars(query.limit(1)).first()


# --- audit reports: read, list, fill in (the API's audit jobs) ---------------------------


AUDIT_SETTABLE = frozenset(
    {"train_evaluator", "reference_evaluator", "n_rollouts", "report", "verdict", "html_path"}
)


def get_audit_report(session: Session, audit_id: int) -> AuditReport | None:
    return session.get(AuditReport, audit_id)


def list_audit_reports(session: Session, *, limit: int = 50, offset: int = 0) -> list[AuditReport]:
    """Audit reports, newest first."""
    query = select(AuditReport).order_by(AuditReport.id.desc()).limit(limit).offset(offset)
    return list(session.scalars(query))


def move_audit_report(
    session: Session, audit_id: int, from_verdicts: Sequence[str], **fields: Any
) -> bool:
    """Set columns of a report whose `verdict` is still one of ``from_verdicts``, in ONE
    conditional UPDATE (of two racing writers, the first to commit wins); False when the row
    had already moved on (nothing written)."""
    if unknown := set(fields) - AUDIT_SETTABLE:
        raise ValueError(f"audit reports have no settable column(s) {sorted(unknown)}")
    result = session.execute(
        update(AuditReport)
        .where(AuditReport.id == audit_id, AuditReport.verdict.in_(list(from_verdicts)))
        .values(**fields)
        .execution_options(synchronize_session=False)
    )
    session.expire_all()
    return bool(cast(CursorResult[Any], result).rowcount == 1)


def update_audit_report(session: Session, audit_id: int, **fields: Any) -> AuditReport:
    """Set columns of a stored report (a queued audit job filled in, or marked failed)."""
    row = session.get(AuditReport, audit_id)
    if row is None:
        raise LookupError(f"no audit report with id {audit_id}")
    for name, value in fields.items():
        if name not in AUDIT_SETTABLE:
            raise ValueError(f"audit reports have no settable column {name!r}")
        setattr(row, name, value)
    session.flush()
    return row
