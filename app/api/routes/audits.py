"""Evaluator-agreement audits: start one (admin; runs as a job), list, read, the HTML report,
cancel (admin).

The job is ``casi audit run ... --into <id>`` (:mod:`app.workers.audit_jobs`): the same
service function as the CLI, in its own process, so an audit's sampling never blocks the
API's compute thread. A row reads ``queued`` / ``running`` until the job fills it in; cancel
is the training jobs' cancel (same state machine, process group stopped, slot freed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import anyio
from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import Admin, KeyFirstRoute, Limit, Offset, RecordId, State, User
from app.api.errors import AUTHENTICATED, ApiError, documented
from app.db import repositories as repo
from app.db import session_scope
from app.errors import UnknownPolicy
from app.reports.audit_html import render_html
from app.schemas import (
    DB_INT_MAX,
    EVALUATORS,
    MIN_TEMPERATURE,
    Evaluator,
    JsonInt,
    JsonNumber,
    OptionalJsonInt,
)
from app.services import audit as service
from app.training.policy_loader import find_registered
from app.workers import audit_jobs
from evaluator.limits import MAX_PLAYERS

router = APIRouter(
    prefix="/v1/audits",
    tags=["audits"],
    responses=documented(*AUTHENTICATED),
    route_class=KeyFirstRoute,
)


_AUDIT_EXAMPLE: dict[str, Any] = {
    "id": 1, "status": "finished", "verdict": "partial", "created_at": "2026-11-30T22:00:00Z",
    "train_evaluator": "surrogate", "reference_evaluator": "replay", "n_rollouts": 400,
    "recommended_credit": "leave_one_out", "agreement_by_size": [0.91, 0.84, 0.79, 0.75],
    "error": None, "report_url": "/v1/audits/1/report",
}  # fmt: skip
_CANCELLED_EXAMPLE: dict[str, Any] = {
    "id": 2, "status": "cancelled", "verdict": "cancelled", "created_at": "2026-11-30T22:10:00Z",
    "train_evaluator": "cosine", "reference_evaluator": "replay", "n_rollouts": 0,
    "recommended_credit": None, "agreement_by_size": [], "error": "cancelled by request",
    "report_url": None,
}  # fmt: skip
# The head of a report (the whole document: app/reports/audit_schema.json).
_REPORT_EXAMPLE: dict[str, Any] = {
    "schema_version": 1, "train_evaluator": "surrogate", "reference_evaluator": "replay",
    "n_rollouts": 400, "verdict": "partial", "recommended_credit": "leave_one_out",
}  # fmt: skip


REFERENCE: Evaluator = "replay"  # the default ground truth
# The training evaluator is not the reference: stated in the schema (the server says 422).
_NOT_ITS_OWN_REFERENCE: dict[str, Any] = {
    "not": {
        "anyOf": [
            {
                "required": ["evaluator"] if name == REFERENCE else ["evaluator", "reference"],
                "properties": {"evaluator": {"const": name}, "reference": {"const": name}},
            }
            for name in EVALUATORS
        ]
    }
}


class AuditCreate(BaseModel):
    """`casi audit run`'s options. Default: a quick audit, 20 TEST claims × 2 samples × m = 4
    (about 5 minutes on 2 CPU cores); `"size": "full"` is the CLI's 100 × 4 (about 50 min)."""

    # cosine: an evaluator every server has (surrogate only once fitted; the OpenAPI lists
    # the ones this server has, and the example must be one of them).
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"evaluator": "cosine"},
                {"evaluator": "cosine", "size": "full"},
                {"evaluator": "cosine", "queries": 50, "samples": 4},
            ],
            **_NOT_ITS_OWN_REFERENCE,
        },
    )
    evaluator: Evaluator = Field(
        description="Training evaluator: surrogate | cosine (not the reference)."
    )
    reference: Evaluator = Field(REFERENCE, description="The ground truth (not the evaluator).")
    policy: str | None = Field(
        None, pattern=r"^[0-9a-f]{6,64}$",
        description="A registered policy version (or a unique prefix ≥ 6); unset = the default.",
    )  # fmt: skip
    split: Literal["train", "val", "dev", "test"] = "test"
    size: Literal["quick", "full"] = Field(
        "quick",
        description="quick: 20 claims × 2 samples (40 rollouts, about 5 min on 2 CPU cores); "
        "full: 100 × 4 (400 rollouts, about 50 min), `casi audit run`'s default. "
        "`queries` / `samples` override it.",
    )
    queries: OptionalJsonInt = Field(
        None, ge=1, le=2000, description="Claims (N); unset = the size's: 20 quick, 100 full."
    )
    samples: OptionalJsonInt = Field(
        None, ge=1, le=32, description="Samples per claim (G); unset = the size's: 2 quick, 4 full."
    )
    n_actions: JsonInt = Field(4, ge=1, le=MAX_PLAYERS)
    from_run: OptionalJsonInt = Field(
        None, ge=1, le=DB_INT_MAX, description="Audit a run's stored actions instead."
    )
    seed: JsonInt = Field(0, ge=0, le=DB_INT_MAX)
    temperature: JsonNumber = Field(
        0.7, ge=MIN_TEMPERATURE, le=5.0,
        description=f"Sampling temperature, at least {MIN_TEMPERATURE} (a smaller one overflows "
        "the logits past the constrained format's mask).",
    )  # fmt: skip
    format: Literal["constrained", "free"] = Field(
        "constrained", description="constrained: every rollout is an m-player game by construction."
    )
    line_cap: JsonInt = Field(24, ge=2, le=48, description="Tokens per rewrite line.")
    max_new_tokens: OptionalJsonInt = Field(
        None, ge=8, le=512, description="format free only (default derived from m and line_cap)."
    )
    tol: JsonNumber = Field(1e-3, ge=0.0, le=1.0)
    threshold: JsonNumber = Field(0.8, gt=0.0, le=1.0)
    n_boot: JsonInt = Field(1000, ge=10, le=20000)

    def audit_request(self) -> service.AuditRequest:
        """The service's request: the size resolved into claims and samples (ValueError when
        the service refuses it)."""
        queries, samples = service.AUDIT_SIZES[self.size]
        fields = self.model_dump(exclude={"evaluator", "size", "queries", "samples"})
        return service.AuditRequest(
            evaluators=(self.evaluator,), queries=self.queries or queries,
            samples=self.samples or samples, **fields,
        )  # fmt: skip


class AuditOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [_AUDIT_EXAMPLE, _CANCELLED_EXAMPLE]})
    id: int
    status: str = Field(description="queued | running | finished | failed | cancelled")
    verdict: str  # agrees | partial | disagrees once finished (else the status)
    created_at: str | None
    train_evaluator: str
    reference_evaluator: str
    n_rollouts: int
    recommended_credit: str | None
    agreement_by_size: list[float | None]
    error: str | None = None
    report_url: str | None = None


class AuditDetail(AuditOut):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{**_AUDIT_EXAMPLE, "report": _REPORT_EXAMPLE}]}
    )
    report: dict[str, Any]


class AuditList(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"items": [_AUDIT_EXAMPLE], "limit": 50, "offset": 0}]}
    )
    items: list[AuditOut]
    limit: int
    offset: int


def _out(found: dict[str, Any], cls: type[AuditOut] = AuditOut) -> AuditOut:
    report = found.get("report") or {}
    url = f"/v1/audits/{found['id']}/report" if found["status"] == "finished" else None
    extra = {"report": report} if cls is AuditDetail else {}
    keys = AuditOut.model_fields.keys() - {"error", "report_url"}
    return cls(**{k: found[k] for k in keys}, error=report.get("error"), report_url=url, **extra)


def _read(state: State, audit_id: int) -> dict[str, Any]:
    audit_jobs.reconcile(state.factory, audit_id)
    found = service.get_audit(state.factory, audit_id)
    if found is None:
        raise ApiError(404, f"no audit {audit_id}", field="path.audit_id")
    return found


@router.post("", response_model=AuditOut, status_code=202, responses=documented(403, 404, 409, 413))
def start_audit(req: AuditCreate, state: State, _: Admin) -> AuditOut:
    """Queue an audit and start it as a job; poll `GET /v1/audits/{id}` for its status. 422
    naming `body.evaluator` / `body.reference` for an evaluator this server has not built;
    404 naming `body.policy` for an unknown policy version, `body.from_run` for a training
    run that does not exist; 409 when CASI_API_MAX_RUNNING_JOBS jobs are queued or running."""
    for field, name in (("body.evaluator", req.evaluator), ("body.reference", req.reference)):
        if name not in state.scorers:
            raise ApiError(
                422,
                f"evaluator {name!r} is not available; available: {sorted(state.scorers)}",
                field=field,
            )
    if req.policy is not None:  # only registered versions: never a path on this machine
        try:
            req.policy = find_registered(state.factory, req.policy)
        except UnknownPolicy as exc:
            raise ApiError(404, str(exc), field="body.policy") from None
    if req.from_run is not None and not _run_exists(state, req.from_run):
        raise ApiError(404, f"no training run {req.from_run}", field="body.from_run")
    try:
        request = req.audit_request()
    except ValueError as exc:
        raise ApiError(422, str(exc), field="body") from None
    audit_id = audit_jobs.start(
        state.factory, request, Path(state.settings.var_dir) / "jobs",
        admission=state.jobs.admission(state.settings.api_max_running_jobs),  # 409 over the cap
    )  # fmt: skip
    return _out(_read(state, audit_id))


def _run_exists(state: State, run_id: int) -> bool:
    with session_scope(state.factory) as session:
        return repo.get_run(session, run_id) is not None


@router.post("/{audit_id}/cancel", response_model=AuditOut, responses=documented(403, 404, 409))
def cancel_audit(audit_id: RecordId, state: State, _: Admin) -> AuditOut:
    """Mark the audit cancelled, then stop its process group (SIGTERM, then SIGKILL): the
    training jobs' cancel, and its job slot is free. Idempotent: cancelling a cancelled audit
    answers it again; 409 once it finished or failed."""
    audit_jobs.cancel(state.factory, audit_id)
    return _out(_read(state, audit_id))


@router.get("", response_model=AuditList)
def list_audits(state: State, _: User, limit: Limit = 50, offset: Offset = 0) -> AuditList:
    """Audits, newest first."""
    rows = service.list_audits(state.factory, limit=limit, offset=offset)
    for row in rows:
        if row["status"] == "running":
            audit_jobs.reconcile(state.factory, row["id"])
    rows = service.list_audits(state.factory, limit=limit, offset=offset)
    return AuditList(items=[_out({**r, "report": {}}) for r in rows], limit=limit, offset=offset)


@router.get("/{audit_id}", response_model=AuditDetail, responses=documented(404))
def read_audit(audit_id: RecordId, state: State, _: User) -> AuditOut:
    """Status, verdict and the full report JSON (see `app/reports/audit_schema.json`)."""
    return _out(_read(state, audit_id), AuditDetail)


@router.get(
    "/{audit_id}/report", response_class=HTMLResponse,
    responses={200: {"content": {"text/html": {"example": "<!doctype html><html>…</html>"}}},
               **documented(404, 409)},
)  # fmt: skip
async def audit_report(audit_id: RecordId, state: State, _: User) -> HTMLResponse:
    """The self-contained HTML report (re-rendered from the stored JSON if its file is gone)."""
    found = await anyio.to_thread.run_sync(_read, state, audit_id)
    if found["status"] != "finished":
        raise ApiError(
            409, f"audit {audit_id} is {found['status']}: no report yet", field="path.audit_id"
        )
    path = Path(found["html_path"]) if found["html_path"] else None
    if path is not None and path.is_file():
        html = await anyio.to_thread.run_sync(path.read_text)
    else:
        html = await anyio.to_thread.run_sync(render_html, found["report"])
    return HTMLResponse(html)
