"""Policies (lineage, held-out numbers, the served one; activate), training jobs (status, log
tail live; start / cancel) and audits (verdicts, agreement by size, each report embedded;
cancel).

State changes go through the same services as the REST API (`app.services.policies.activate`,
`JobRunner.start` / `cancel` with `app.schemas_ops.TrainJobRequest`, `app.workers.audit_jobs.cancel`),
each behind the CSRF check and the admin scope (:func:`app.ui.render.checked_form`).
"""

from __future__ import annotations

import math
import types
from pathlib import Path as FsPath
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import anyio
from fastapi import APIRouter, Path, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from sqlalchemy import func, select

from app.db import session_scope
from app.db.models import AuditReport, TrainJob
from app.errors import InvalidField, JobConflict, PolicyUnloadable, UnknownPolicy
from app.reports.audit_html import render_html
from app.schemas import DB_INT_MAX
from app.schemas_ops import TrainJobRequest
from app.services import audit as audit_service
from app.services import policies as policy_service
from app.ui import data, security
from app.ui.render import Ctx, UiCtx, UiError, checked_form, fmt, page, pages, redirect
from app.workers import audit_jobs
from app.workers.jobs import JOB_FIELDS
from policy.losses import available_presets

router = APIRouter(prefix="/ui", include_in_schema=False)
PER_PAGE = 25
LOG_TAIL_BYTES = 16_384
Id = Annotated[int, Path(ge=1, le=DB_INT_MAX)]
PageNo = Annotated[int, Query(alias="page", ge=0, le=100_000)]
Version = Annotated[str, Path(min_length=6, max_length=64, pattern=r"^[0-9a-f]+$")]
DEFAULT_PRESET = "casi"
MAX_POLICY_CHOICES = 200
INT_FIELDS = {"steps", "queries", "samples", "n_actions", "seed", "max_docs", "max_new_tokens",
              "eval_every", "eval_queries", "checkpoint_every"}  # fmt: skip


def _count(ctx: Ctx, model: Any) -> Any:
    def job() -> int:
        with session_scope(ctx.state.factory) as session:
            return int(session.scalar(select(func.count()).select_from(model)) or 0)

    return ctx.state.run_read(job)


# --- policies ---------------------------------------------------------------------------


@router.get("/policies")
async def policies(ctx: UiCtx, page_no: PageNo = 0) -> Response:
    def job() -> Any:
        with session_scope(ctx.state.factory) as s:
            return data.policies_page(s, limit=PER_PAGE, offset=PER_PAGE * page_no)

    rows, total = await ctx.state.run_read(job)
    return page("policies.html", ctx, policies=rows, served=ctx.served_version,
                pager=pages(total, PER_PAGE, page_no))  # fmt: skip


@router.get("/policies/{version}")
async def policy(ctx: UiCtx, version: Version) -> Response:
    def job() -> Any:
        full = policy_service.find_registered(ctx.state.factory, version, "path.version")
        with session_scope(ctx.state.factory) as s:
            return data.policy_detail(s, full)

    try:
        found = await ctx.state.run_read(job)
    except UnknownPolicy as exc:
        raise UiError(404, str(exc)) from None
    return page("policy.html", ctx, p=found, served=ctx.served_version)


@router.post("/policies/{version}/activate")
async def activate(ctx: UiCtx, version: Version) -> Response:
    """Serve this version (admin): the REST API's activation, loaded off the event loop."""
    await checked_form(ctx, admin=True)
    s = ctx.state.settings
    try:
        async with ctx.state.activation:
            out = await anyio.to_thread.run_sync(
                lambda: policy_service.activate(ctx.state.factory, ctx.state.batcher, version, var_dir=s.var_dir,
                                                device=s.resolved_device(), precision=s.api_precision)
            )  # fmt: skip
    except UnknownPolicy as exc:
        raise UiError(404, str(exc)) from None
    except PolicyUnloadable as exc:  # weights missing or damaged: still serving the old one
        raise UiError(409, str(exc)) from None
    return redirect(f"/ui/policies/{out.version}")


# --- jobs -------------------------------------------------------------------------------


async def _jobs_page(ctx: Ctx, page_no: int, status: int = 200, errors: list[str] | None = None,
                     values: dict[str, str] | None = None) -> Response:  # fmt: skip
    listing = await ctx.state.run_read(
        lambda: ctx.state.jobs.list_jobs(limit=PER_PAGE, offset=PER_PAGE * page_no, status=None)
    )
    total = await _count(ctx, TrainJob)
    presets = available_presets()
    default = DEFAULT_PRESET if DEFAULT_PRESET in presets else presets[0] if presets else ""
    return page("jobs.html", ctx, status, jobs=listing.items, pager=pages(total, PER_PAGE, page_no),
                presets=presets, fields=[f for f in JOB_FIELDS if f != "policy"] + ["policy"],
                choices=await _job_choices(ctx), errors=errors or [],
                values={"preset": default, **(values or {})})  # fmt: skip


def literal_values(annotation: Any) -> list[str] | None:
    """The values of a ``Literal`` field type (inside ``X | None`` too), else None."""
    if get_origin(annotation) is Literal:
        return [str(v) for v in get_args(annotation)]
    if get_origin(annotation) in (Union, types.UnionType):
        for arg in get_args(annotation):
            found = literal_values(arg)
            if found is not None:
                return found
    return None


async def _job_choices(ctx: Ctx) -> dict[str, list[dict[str, Any]]]:
    """The job form's drop-downs, each {value, label, disabled}: every field of
    `TrainJobRequest` typed as a Literal (evaluator, format: its valid values; an evaluator
    this server did not build is listed, disabled) and the policy (the registered versions,
    newest first). The form adds a blank first option: unset, the preset's default."""
    scorers = getattr(ctx.state, "scorers", None) or {}
    choices: dict[str, list[dict[str, Any]]] = {}
    for name in JOB_FIELDS:
        values = literal_values(TrainJobRequest.model_fields[name].annotation)
        if values is None:
            continue
        off = {v for v in values if name == "evaluator" and scorers and v not in scorers}
        choices[name] = [
            {"value": v, "label": v + (" (not available here)" if v in off else ""), "disabled": v in off}
            for v in values
        ]  # fmt: skip

    def versions() -> list[dict[str, Any]]:
        with session_scope(ctx.state.factory) as s:
            rows = data.policy_choices(s, limit=MAX_POLICY_CHOICES)
        return [{"value": p["version"], "label": p["label"], "disabled": False} for p in rows]

    choices["policy"] = await ctx.state.run_read(versions)
    return choices


@router.get("/jobs")
async def jobs(ctx: UiCtx, page_no: PageNo = 0) -> Response:
    return await _jobs_page(ctx, page_no)


def _job_request(form: dict[str, str]) -> TrainJobRequest:
    """The form as the REST API's request model (same validation); blank fields are unset."""
    body: dict[str, Any] = {"preset": form.get("preset", "")}
    for name in JOB_FIELDS:
        raw = form.get(name, "").strip()
        if not raw:
            continue
        if name in INT_FIELDS:
            try:
                body[name] = int(raw)
            except ValueError:
                body[name] = raw  # the model reports it as not an integer
        elif name == "lr":
            try:
                body[name] = float(raw)
            except ValueError:
                body[name] = raw
        else:
            body[name] = raw
    return TrainJobRequest(**body)


@router.post("/jobs")
async def start_job(ctx: UiCtx) -> Response:
    form = await checked_form(ctx, admin=True)
    values = {k: v for k, v in form.items() if k != "csrf"}
    try:
        req = _job_request(form)
    except ValidationError as exc:
        errors = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return await _jobs_page(ctx, 0, 422, errors, values)
    try:
        out = await anyio.to_thread.run_sync(
            lambda: ctx.state.jobs.start(req, max_running=ctx.state.settings.api_max_running_jobs,
                                         evaluators=ctx.state.scorers)
        )  # fmt: skip
    except InvalidField as exc:
        return await _jobs_page(ctx, 0, 422, [f"{exc.field}: {exc}"], values)
    except UnknownPolicy as exc:
        return await _jobs_page(ctx, 0, 404, [f"{exc.field}: {exc}"], values)
    except JobConflict as exc:
        return await _jobs_page(ctx, 0, 409, [str(exc)], values)
    return redirect(f"/ui/jobs/{out.id}")


def _tail(path: str | None) -> str:
    if not path:
        return ""
    p = FsPath(path)
    try:
        with p.open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - LOG_TAIL_BYTES))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


async def _job(ctx: Ctx, job_id: int) -> tuple[Any, str]:
    try:
        out = await ctx.state.run_read(ctx.state.jobs.get, job_id)
    except LookupError:
        raise UiError(404, f"no training job {job_id}") from None

    def log_path() -> str | None:
        with session_scope(ctx.state.factory) as s:
            row = s.get(TrainJob, job_id)
            return row.log_path if row else None

    return out, _tail(await ctx.state.run_read(log_path))


@router.get("/jobs/{job_id}")
async def job(ctx: UiCtx, job_id: Id) -> Response:
    out, log = await _job(ctx, job_id)
    return page("job.html", ctx, job=out, log=log)


def finite_or_none(value: Any) -> Any:
    """A metric as JSON can carry it: NaN and ±inf (a diverged step) are null, as the REST
    API's `latest_metrics` writes them (JSON has no such numbers; the response refused them)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


@router.get("/jobs/{job_id}/live")
async def job_live(ctx: UiCtx, job_id: Id) -> Response:
    """What the job page's script polls while the job runs (JSON; ``shown``: each metric as the
    page prints it, :func:`app.ui.render.fmt`)."""
    out, log = await _job(ctx, job_id)
    metrics = out.latest_metrics or {}
    body = {"status": out.status, "step": out.step,
            "metrics": {k: finite_or_none(v) for k, v in metrics.items()},
            "shown": {k: fmt(v) for k, v in metrics.items()}, "log": log, "error": out.error}  # fmt: skip
    return JSONResponse(body, headers=security.security_headers())


@router.post("/jobs/{job_id}/cancel")
async def cancel_job(ctx: UiCtx, job_id: Id) -> Response:
    await checked_form(ctx, admin=True)
    try:
        await anyio.to_thread.run_sync(ctx.state.jobs.cancel, job_id)
    except JobConflict as exc:
        raise UiError(409, str(exc)) from None
    except LookupError:
        raise UiError(404, f"no training job {job_id}") from None
    return redirect(f"/ui/jobs/{job_id}")


# --- audits -----------------------------------------------------------------------------


@router.get("/audits")
async def audits(ctx: UiCtx, page_no: PageNo = 0) -> Response:
    rows = await ctx.state.run_read(
        lambda: audit_service.list_audits(
            ctx.state.factory, limit=PER_PAGE, offset=PER_PAGE * page_no
        )
    )
    total = await _count(ctx, AuditReport)
    return page("audits.html", ctx, audits=rows, pager=pages(total, PER_PAGE, page_no))


async def _audit(ctx: Ctx, audit_id: int) -> dict[str, Any]:
    def read() -> dict[str, Any] | None:
        audit_jobs.reconcile(ctx.state.factory, audit_id)  # a dead process is not "running"
        return audit_service.get_audit(ctx.state.factory, audit_id)

    found = await ctx.state.run_read(read)
    if found is None:
        raise UiError(404, f"no audit {audit_id}")
    return dict(found)


@router.get("/audits/{audit_id}")
async def audit(ctx: UiCtx, audit_id: Id) -> Response:
    found = await _audit(ctx, audit_id)
    report = found.get("report") or {}
    return page("audit.html", ctx, a=found, sizes=report.get("sizes") or [],
                summary=report.get("summary"), finished=found["status"] == "finished")  # fmt: skip


@router.post("/audits/{audit_id}/cancel")
async def cancel_audit(ctx: UiCtx, audit_id: Id) -> Response:
    """Cancel a queued or running audit (admin): the REST API's cancel, the jobs' machinery."""
    await checked_form(ctx, admin=True)
    try:
        await anyio.to_thread.run_sync(audit_jobs.cancel, ctx.state.factory, audit_id)
    except JobConflict as exc:
        raise UiError(409, str(exc)) from None
    except LookupError:
        raise UiError(404, f"no audit {audit_id}") from None
    return redirect(f"/ui/audits/{audit_id}")


@router.get("/audits/{audit_id}/report")
async def audit_report(ctx: UiCtx, audit_id: Id) -> Response:
    """The project's self-contained HTML report, framed by the audit page (no script runs)."""
    found = await _audit(ctx, audit_id)
    if found["status"] != "finished":
        raise UiError(409, f"audit {audit_id} is {found['status']}: no report yet")
    html = await anyio.to_thread.run_sync(render_html, found["report"])
    return HTMLResponse(html, headers=security.security_headers(security.REPORT_CSP))
