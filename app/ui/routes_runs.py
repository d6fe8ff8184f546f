"""Runs, a run's curves, several runs overlaid, and the credit explorer (a step's queries and
their samples; the stored API credits listed at /ui/credits, each at /ui/credits/{id})."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from fastapi.responses import Response

from app.db import session_scope
from app.db.models import CreditRecord
from app.schemas import DB_INT_MAX
from app.ui import charts, data
from app.ui.hits import add_hits
from app.ui.render import Ctx, UiCtx, UiError, page, pages

router = APIRouter(prefix="/ui", include_in_schema=False)
RUNS_PER_PAGE = 25
STEPS_PER_PAGE = 40
MAX_OVERLAY = 8
Id = Annotated[int, Path(ge=1, le=DB_INT_MAX)]
Page = Annotated[int, Query(ge=0, le=100_000)]
StepNo = Annotated[int, Path(ge=0, le=DB_INT_MAX)]


async def _read(ctx: Ctx, fn: Any, *args: Any) -> Any:
    def job() -> Any:
        with session_scope(ctx.state.factory) as session:
            return fn(session, *args)

    return await ctx.state.run_read(job)


@router.get("/runs")
async def runs(
    ctx: UiCtx, page_no: Annotated[int, Query(alias="page", ge=0, le=100_000)] = 0
) -> Response:
    rows, total = await _read(
        ctx, lambda s: data.runs_page(s, limit=RUNS_PER_PAGE, offset=RUNS_PER_PAGE * page_no)
    )
    return page("runs.html", ctx, runs=rows, pager=pages(total, RUNS_PER_PAGE, page_no))


@router.get("/runs/{run_id}")
async def run(ctx: UiCtx, run_id: Id, cpage: Page = 0) -> Response:
    def load(s: Any) -> dict[str, Any] | None:
        info = data.get_run_info(s, run_id)
        if info is None:
            return None
        steps, n_steps = data.run_steps(s, run_id)
        credit, n_credit = data.credit_steps(
            s, run_id, limit=STEPS_PER_PAGE, offset=STEPS_PER_PAGE * cpage
        )
        return {"info": info, "steps": steps, "n_steps": n_steps, "evals": data.run_evaluations(s, run_id),
                "checkpoints": data.checkpoints(s, run_id), "credit_steps": credit, "n_credit": n_credit}  # fmt: skip

    found = await _read(ctx, load)
    if found is None:
        raise UiError(404, f"no training run {run_id}")
    last = found["steps"][-1] if found["steps"] else None
    return page(
        "run.html", ctx, **found, last=last, charts=charts.run_charts(found["steps"], found["evals"]),
        cpager=pages(found["n_credit"], STEPS_PER_PAGE, cpage),
    )  # fmt: skip


@router.get("/compare")
async def compare(
    ctx: UiCtx,
    run_ids: Annotated[list[int], Query(alias="run", max_length=MAX_OVERLAY)] = [],  # noqa: B006
) -> Response:
    """Several runs on the same axes (pick them in the runs table)."""
    ids = sorted({i for i in run_ids if 1 <= i <= DB_INT_MAX})[:MAX_OVERLAY]

    def load(s: Any) -> list[dict[str, Any]]:
        out = []
        for run_id in ids:
            info = data.get_run_info(s, run_id)
            if info is not None:
                out.append(
                    {
                        **info,
                        "steps": data.run_steps(s, run_id)[0],
                        "evals": data.run_evaluations(s, run_id),
                    }
                )
        return out

    found = await _read(ctx, load)
    return page(
        "compare.html", ctx, runs=found, charts=charts.overlay_charts(found) if found else []
    )


async def _with_hits(ctx: Ctx, records: list[dict[str, Any]], list_k: int | None) -> None:
    retrieval = getattr(ctx.state, "retrieval", None)
    k = list_k or ctx.state.settings.list_k
    await ctx.state.run_heavy(add_hits, retrieval, records, k)


def _decorate(rec: dict[str, Any], lam: float | None) -> dict[str, Any]:
    rec["figures"] = charts.sample_figures(rec)
    rec["token_adv"] = (
        charts.token_advantages(rec, lam) if lam is not None else [None] * len(rec["shaped"])
    )
    rec["lam"] = lam
    return rec


@router.get("/runs/{run_id}/steps/{step}")
async def explorer(
    ctx: UiCtx, run_id: Id, step: StepNo, page_no: Annotated[int, Query(alias="page", ge=0, le=100_000)] = 0,
    per: Annotated[int, Query(ge=1, le=10)] = 4,
) -> Response:  # fmt: skip
    """The credit of every sample of a page of the step's queries."""

    def load(s: Any) -> dict[str, Any] | None:
        info = data.get_run_info(s, run_id)
        if info is None:
            return None
        groups, total = data.explorer_page(s, run_id, step, per_page=per, page=page_no)
        prev, nxt = data.neighbour_steps(s, run_id, step)
        return {"info": info, "groups": groups, "total": total, "prev_step": prev, "next_step": nxt}

    found = await _read(ctx, load)
    if found is None:
        raise UiError(404, f"no training run {run_id}")
    if not found["total"]:  # a step the run never reached, or one without credit records
        raise UiError(404, f"training run {run_id} has no credit records at step {step}")
    records = [rec for g in found["groups"] for rec in g["samples"]]
    await _with_hits(ctx, records, found["info"]["list_k"])
    for rec in records:
        _decorate(rec, found["info"]["lam"])
    return page("explorer.html", ctx, **found, step=step, per=per,
                pager=pages(found["total"], per, page_no))  # fmt: skip


@router.get("/credits")
async def credits(
    ctx: UiCtx, page_no: Annotated[int, Query(alias="page", ge=0, le=100_000)] = 0
) -> Response:
    """The credit records `POST /v1/credits` stored, newest first (training's are per step)."""
    rows, total = await _read(
        ctx,
        lambda s: data.api_credits_page(s, limit=RUNS_PER_PAGE, offset=RUNS_PER_PAGE * page_no),
    )
    return page("credits.html", ctx, credits=rows, pager=pages(total, RUNS_PER_PAGE, page_no))


@router.get("/credits/{record_id}")
async def credit(ctx: UiCtx, record_id: Id) -> Response:
    """One stored credit record (an API credit, or one rollout of a training step)."""

    def load(s: Any) -> dict[str, Any] | None:
        row = s.get(CreditRecord, record_id)
        if row is None:
            return None
        info = data.get_run_info(s, row.run_id) if row.run_id is not None else None
        return {"rec": data.record_dict(row), "info": info}

    found = await _read(ctx, load)
    if found is None:
        raise UiError(404, f"no credit record {record_id}")
    info = found["info"]
    rec = found["rec"]
    await _with_hits(ctx, [rec], info["list_k"] if info else None)
    _decorate(rec, info["lam"] if info else None)
    return page("credit.html", ctx, rec=rec, info=info)
