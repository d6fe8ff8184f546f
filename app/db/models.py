"""SQLAlchemy 2 models: what CASI stores about policies, runs, credits, audits and API keys.

Read `Base` first (naming convention + shared column types), then the six tables. The
schema is created by Alembic (`migrations/versions/`), never by `create_all`; a test keeps
these models and the migrations identical on SQLite and PostgreSQL.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

# Deterministic constraint/index names on every backend, so migrations can name what they
# alter or drop. Keep in sync with migrations (they are generated from this metadata).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# JSONB on PostgreSQL (indexable, compact), plain JSON elsewhere. `none_as_null=True`: a
# Python None is stored as SQL NULL, not as the JSON literal `null`.
JSONType = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")

HASH_LEN = 64  # sha256 hex digest; also the width of content-hash version strings
NAME_LEN = 200
PATH_LEN = 1024


def utcnow() -> datetime:
    """The current time, timezone-aware, in UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """`DateTime(timezone=True)` that always round-trips aware UTC datetimes.

    PostgreSQL stores `timestamptz`; SQLite has no zone, so values are stored as UTC and
    made aware again on load. Naive datetimes are rejected rather than guessed.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware datetime (UTC)")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSONType}


def _created_at() -> Mapped[datetime]:
    return mapped_column(UTCDateTime(), default=utcnow, server_default=func.now())


def _one_of(column: str, values: type[enum.StrEnum], name: str) -> CheckConstraint:
    allowed = ", ".join(f"'{v.value}'" for v in values)
    return CheckConstraint(f"{column} IN ({allowed})", name=name)


class PolicyKind(enum.StrEnum):
    BASE = "base"
    WARMSTART = "warmstart"
    TRAINED = "trained"


class RunStatus(enum.StrEnum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class PolicyVersion(Base):
    """One policy checkpoint; `version` is its content hash, `parent_id` the one it came from."""

    __tablename__ = "policy_versions"
    __table_args__ = (_one_of("kind", PolicyKind, "kind"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    version: Mapped[str] = mapped_column(String(HASH_LEN), unique=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    base_model: Mapped[str] = mapped_column(String(PATH_LEN))
    path: Mapped[str] = mapped_column(String(PATH_LEN))
    parent_id: Mapped[int | None] = mapped_column(
        ForeignKey("policy_versions.id", ondelete="SET NULL")
    )
    step: Mapped[int] = mapped_column(Integer, default=0)
    kind: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = _created_at()
    meta: Mapped[dict[str, Any]] = mapped_column(default=dict)
    run_id: Mapped[int | None] = mapped_column(
        ForeignKey("training_runs.id", ondelete="SET NULL", use_alter=True)
    )  # the training run that wrote this checkpoint (None for base / warm-start versions)

    parent: Mapped[PolicyVersion | None] = relationship(remote_side=[id], foreign_keys=[parent_id])


class TrainingRun(Base):
    """One training job; `policy_version_id` is the policy it started from."""

    __tablename__ = "training_runs"
    __table_args__ = (_one_of("status", RunStatus, "status"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    preset: Mapped[str] = mapped_column(String(NAME_LEN))
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.RUNNING.value)
    policy_version_id: Mapped[int | None] = mapped_column(
        ForeignKey("policy_versions.id", ondelete="SET NULL")
    )
    started_at: Mapped[datetime] = _created_at()
    finished_at: Mapped[datetime | None]
    notes: Mapped[str | None] = mapped_column(Text)

    policy_version: Mapped[PolicyVersion | None] = relationship(foreign_keys=[policy_version_id])


class StepMetric(Base):
    """Scalar metrics of one training step; `accepted` is the MIPU accept/rollback decision."""

    __tablename__ = "step_metrics"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("training_runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)  # name -> float
    accepted: Mapped[bool | None]
    created_at: Mapped[datetime] = _created_at()


class CreditRecord(Base):
    """The credit of one sampled rewrite set: value table, Shapley φ, baselines, advantages.

    Written by training steps (`run_id`, `step` set) and by `POST /v1/credits` (both NULL).
    """

    __tablename__ = "credit_records"
    __table_args__ = (
        Index(None, "run_id", "step"),
        Index(None, "query_id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("training_runs.id", ondelete="CASCADE"))
    step: Mapped[int | None] = mapped_column(Integer)
    query_id: Mapped[str] = mapped_column(String(NAME_LEN))
    query_text: Mapped[str] = mapped_column(Text)
    sample_index: Mapped[int] = mapped_column(Integer, default=0)
    policy_version: Mapped[str] = mapped_column(String(HASH_LEN))
    actions: Mapped[list[str]] = mapped_column(JSONType)
    format_status: Mapped[str] = mapped_column(String(32), default="ok")
    value_table: Mapped[list[float]] = mapped_column(JSONType)  # v(S) for S = 0 .. 2^m - 1
    credits: Mapped[list[float]] = mapped_column(JSONType)  # Shapley φ, one per action
    baselines: Mapped[dict[str, Any] | None]  # {singleton, leave_one_out, broadcast}
    advantages: Mapped[dict[str, Any] | None]  # {base: A, shaped: x}
    value_full: Mapped[float] = mapped_column(Float)
    efficiency_residual: Mapped[float] = mapped_column(Float)
    index_version: Mapped[str] = mapped_column(String(HASH_LEN))
    embedder_version: Mapped[str] = mapped_column(String(HASH_LEN))
    evaluator_name: Mapped[str] = mapped_column(String(64))
    evaluator_version: Mapped[str] = mapped_column(String(HASH_LEN))
    cache_stats: Mapped[dict[str, Any] | None]
    anchor_query: Mapped[bool] = mapped_column(default=False, server_default=false())
    """The game's mode: True = the query's own list is in every coalition (v(∅) = query alone)."""
    merge: Mapped[str | None] = mapped_column(String(16))
    """How the coalition lists were built: max | rrf (the list game) | pool (the pooled game);
    None on records stored before it was recorded."""
    pool: Mapped[dict[str, Any] | None]
    """The pooled game's who-found-what counts (`app.db.records.pool_summary`); None otherwise."""
    created_at: Mapped[datetime] = _created_at()


class Evaluation(Base):
    """Held-out retrieval of one policy version (`casi eval`, or periodically in `casi train`):
    nDCG@10 / recall@100 of the query alone, the rewrites alone and query + rewrites."""

    __tablename__ = "evaluations"
    __table_args__ = (Index(None, "policy_version_id"), Index(None, "run_id", "step"))

    id: Mapped[int] = mapped_column(primary_key=True)
    policy_version_id: Mapped[int] = mapped_column(
        ForeignKey("policy_versions.id", ondelete="CASCADE")
    )
    run_id: Mapped[int | None] = mapped_column(ForeignKey("training_runs.id", ondelete="CASCADE"))
    step: Mapped[int | None] = mapped_column(Integer)
    split: Mapped[str] = mapped_column(String(32))
    n_queries: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]]  # name -> float
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)  # how it was measured
    created_at: Mapped[datetime] = _created_at()


class AuditReport(Base):
    """An evaluator-agreement audit: the full report JSON and its verdict."""

    __tablename__ = "audit_reports"

    id: Mapped[int] = mapped_column(primary_key=True)
    train_evaluator: Mapped[str] = mapped_column(String(64))
    reference_evaluator: Mapped[str] = mapped_column(String(64))
    n_rollouts: Mapped[int] = mapped_column(Integer)
    report: Mapped[dict[str, Any]]
    verdict: Mapped[str] = mapped_column(String(64))
    html_path: Mapped[str | None] = mapped_column(String(PATH_LEN))
    created_at: Mapped[datetime] = _created_at()


class ApiScope(enum.StrEnum):
    USER = "user"  # rewrites, credits, reading policies and jobs
    ADMIN = "admin"  # also: start / cancel training jobs, activate a policy


class ApiKey(Base):
    """A REST API key. Only its sha256 is stored; `prefix` is shown to identify it."""

    __tablename__ = "api_keys"
    __table_args__ = (_one_of("scope", ApiScope, "scope"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    key_hash: Mapped[str] = mapped_column(String(HASH_LEN), unique=True)
    prefix: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime] = _created_at()
    revoked_at: Mapped[datetime | None]
    scope: Mapped[str] = mapped_column(
        String(16), default=ApiScope.USER.value, server_default=ApiScope.USER.value
    )


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {  # state → the states it may move to
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.RUNNING: frozenset({JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELLED}),
}
"""THE state machine of a background job, a training job (`train_jobs.status`) or an audit
(`audit_reports.verdict` while it is pending): queued → running → finished | failed |
cancelled, and queued → failed | cancelled. Every change is a conditional UPDATE from
:func:`sources` (app/workers/jobs.py, app/services/audit.py)."""


def sources(to: JobStatus) -> tuple[str, ...]:
    """The states allowed to move to ``to`` (what a conditional UPDATE's WHERE accepts)."""
    return tuple(s.value for s, targets in TRANSITIONS.items() if to in targets)


class TrainJob(Base):
    """A `casi train` process started by `POST /v1/train-jobs`; its run is `run_name`'s run.

    `pid` is the process (and process-group) id while it runs; the API reconciles a
    `running` job whose process is gone into `finished` / `failed` (see app/workers/jobs.py).
    """

    __tablename__ = "train_jobs"
    __table_args__ = (_one_of("status", JobStatus, "status"), Index(None, "status"))

    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED.value)
    preset: Mapped[str] = mapped_column(String(NAME_LEN))
    overrides: Mapped[dict[str, Any]] = mapped_column(default=dict)
    pid: Mapped[int | None] = mapped_column(Integer)
    log_path: Mapped[str | None] = mapped_column(String(PATH_LEN))
    run_name: Mapped[str | None] = mapped_column(String(NAME_LEN))
    exit_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = _created_at()
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
