"""An audit's request and its stored row: what to audit (:class:`AuditRequest`, validated
once), and the ``audit_reports`` row of an audit job as it moves by the jobs' state machine
(:data:`app.db.models.TRANSITIONS`): queued (:func:`add_pending`), running, failed or cancelled
(:func:`set_status`, one conditional UPDATE), read back (:func:`get_audit`, :func:`list_audits`).

Read :func:`set_status`. The audit itself (rollouts, one credit call, the report) is
`app.services.audit.run_audit`; the job process around it is `app.workers.audit_jobs`. Both
stand on this module, which imports neither.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import JobStatus, sources
from app.training.splits import SPLITS
from evaluator.audit import AuditConfig
from evaluator.shapley import MAX_PLAYERS
from policy.constrain import DEFAULT_LINE_CAP, FORMATS
from policy.prompts import PROMPT_STYLES

PENDING = ("queued", "running")
"""`verdict` of a row whose audit job has not ended (its report holds the request); it moves
on by the jobs' state machine (:data:`app.db.models.TRANSITIONS`): to a verdict once the
report is stored, or to failed / cancelled."""


@dataclass(frozen=True)
class AuditRequest:
    """What to audit. Defaults: 100 TEST claims × 4 samples × m = 4 of the default policy."""

    evaluators: tuple[str, ...]
    """Training evaluator(s): surrogate | cosine (any registered scorer); several are audited
    on the SAME rollouts and coalition lists, one report each."""
    reference: str = "replay"
    policy: str | None = None
    """Registered version (or unique prefix), a model folder, or None = default SmolLM2."""
    split: str = "test"
    queries: int = 100
    samples: int = 4
    n_actions: int = 4
    from_run: int | None = None
    """Audit the actions stored in this run's credit records instead of sampling."""
    from_rollouts: str | None = None
    """Or re-audit the rollouts an earlier audit saved (``audit-<id>-rollouts.json``)."""
    seed: int = 0
    temperature: float = 0.7
    max_new_tokens: int | None = None
    """Free format only (None = derived from m and line_cap)."""
    format: str = "constrained"
    """constrained: every rollout is an m-player game by construction; free: as the model writes."""
    line_cap: int = DEFAULT_LINE_CAP
    precision: str = "float32"
    batch_queries: int = 8
    """Queries per sampling call (each call generates batch_queries × samples rows)."""
    prompt: str = "oneshot"
    """The prompt style the policy is sampled with (a warm start taught ``short`` is sampled
    as it trains with ``short``)."""
    anchor_query: bool = True
    tol: float = AuditConfig.tol
    threshold: float = AuditConfig.threshold
    n_boot: int = AuditConfig.n_boot

    def __post_init__(self) -> None:
        if not self.evaluators or len(set(self.evaluators)) != len(self.evaluators):
            raise ValueError(
                f"give one or more distinct training evaluators, got {self.evaluators}"
            )
        if self.reference in self.evaluators:
            raise ValueError(f"{self.reference!r} is both the reference and a training evaluator")
        if min(self.queries, self.samples, self.batch_queries, self.max_new_tokens or 1) < 1:
            raise ValueError("queries, samples, batch_queries and max_new_tokens must be ≥ 1")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got {self.format!r}")
        if self.prompt not in PROMPT_STYLES:
            raise ValueError(f"prompt must be one of {list(PROMPT_STYLES)}, got {self.prompt!r}")
        if not 1 <= self.n_actions <= MAX_PLAYERS:
            raise ValueError(f"n_actions must be in 1..{MAX_PLAYERS}, got {self.n_actions}")
        if self.split not in SPLITS:
            raise ValueError(f"unknown split {self.split!r}; valid: {list(SPLITS)}")
        self.config()  # tol / threshold / n_boot checked once, here

    def config(self) -> AuditConfig:
        return AuditConfig(
            tol=self.tol, threshold=self.threshold, n_boot=self.n_boot, seed=self.seed
        )


def plain_request(request: AuditRequest) -> dict[str, Any]:
    """The request as JSON-ready data (what the stored report holds)."""
    return {**asdict(request), "evaluators": list(request.evaluators)}


def add_pending(session: Session, request: AuditRequest) -> int:
    """A queued row for an audit job, in the caller's transaction (the jobs' admission); the
    job fills it in by id."""
    row = repo.add_audit_report(
        session, train_evaluator=",".join(request.evaluators), reference_evaluator=request.reference,
        n_rollouts=0, report={"status": "queued", "request": plain_request(request)}, verdict="queued",
    )  # fmt: skip
    return row.id


def create_pending(factory: sessionmaker[Session], request: AuditRequest) -> int:
    """A queued row for an audit job (:func:`add_pending` in a transaction of its own)."""
    with session_scope(factory) as session:
        return add_pending(session, request)


def set_status(factory: sessionmaker[Session], audit_id: int, status: str, **extra: Any) -> bool:
    """Move a pending row to ``status`` (running, failed, cancelled) by the jobs' state machine,
    merging ``extra`` into its report: one conditional UPDATE from the states allowed to reach
    it (:func:`app.db.models.sources`), so of two racing writers (a cancel and the watcher that
    sees the killed process) the first to commit wins. Not allowed (a finished, failed or
    cancelled row is never overwritten) → False."""
    allowed = sources(JobStatus(status))
    with session_scope(factory) as session:
        row = repo.get_audit_report(session, audit_id)
        if row is None:
            raise LookupError(f"no audit report with id {audit_id}")
        if row.verdict not in allowed:
            return False
        report = {**row.report, "status": status, **extra}
        return repo.move_audit_report(session, audit_id, allowed, verdict=status, report=report)


def summary_row(row: Any) -> dict[str, Any]:
    """What a listing shows of one stored audit."""
    report = row.report or {}
    return {
        "id": row.id, "created_at": row.created_at.isoformat() if row.created_at else None,
        "train_evaluator": row.train_evaluator, "reference_evaluator": row.reference_evaluator,
        "n_rollouts": row.n_rollouts, "verdict": row.verdict,
        "status": report.get("status", "finished"),
        "recommended_credit": report.get("recommended_credit"), "html_path": row.html_path,
        "agreement_by_size": [s["agree"] for s in report.get("sizes", [])],
    }  # fmt: skip


def list_audits(
    factory: sessionmaker[Session], *, limit: int = 50, offset: int = 0
) -> list[dict[str, Any]]:
    with session_scope(factory) as session:
        return [
            summary_row(r) for r in repo.list_audit_reports(session, limit=limit, offset=offset)
        ]


def get_audit(factory: sessionmaker[Session], audit_id: int) -> dict[str, Any] | None:
    """A stored audit: its listing fields plus the full report JSON."""
    with session_scope(factory) as session:
        row = repo.get_audit_report(session, audit_id)
        return None if row is None else {**summary_row(row), "report": row.report}
