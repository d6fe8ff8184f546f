"""The dashboard's database reads: every one bounded (a page, a limit, or a stride), every one
returning plain dicts so templates never touch a live ORM session.

Writes go through the services (`app.workers.jobs`, `app.services.policies`), never here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from sqlalchemy import distinct, func, select
from sqlalchemy.orm import Session

from app.db import repositories as repo
from app.db.models import CreditRecord, Evaluation, PolicyVersion, StepMetric, TrainingRun
from app.db.records import game_of
from app.reports.run import _preset_credit
from evaluator.shapley import broadcast
from policy.advantages import ShapingConfig
from policy.train_config import flat_view, stored_section

MAX_CURVE_POINTS = 2000  # step rows read for a run's curves (a longer run is read with a stride)
MAX_CHECKPOINTS = 200
MAX_EVALUATIONS = 500
MAX_SAMPLES_PER_QUERY = 64  # G is at most 64 (TrainJobRequest.samples)
MAX_LINEAGE = 50


def train_config(config: dict[str, Any]) -> dict[str, Any]:
    """The TrainConfig part of a stored run config (`casi train` nests it under "train"), with
    its options flat (either stored layout: `policy.train_config.flat_view`)."""
    inner = config.get("train")
    return flat_view(inner if isinstance(inner, dict) else config)


def run_info(run: TrainingRun) -> dict[str, Any]:
    cfg = train_config(dict(run.config or {}))
    return {
        "id": run.id, "name": run.name, "preset": run.preset, "status": run.status,
        "credit": cfg.get("credit") or _preset_credit(cfg), "anchor": cfg.get("anchor_query"),
        "evaluator": (run.config or {}).get("evaluator", "—"), "started_at": run.started_at,
        "finished_at": run.finished_at, "notes": run.notes, "config": dict(run.config or {}),
        "lam": float(stored_section(cfg, "advantages").get("lam", ShapingConfig().lam)),
        "list_k": cfg.get("list_k"),
    }  # fmt: skip


def _latest_eval(session: Session, run_id: int) -> Evaluation | None:
    query = (
        select(Evaluation).where(Evaluation.run_id == run_id)
        .order_by(Evaluation.step.desc(), Evaluation.id.desc()).limit(1)
    )  # fmt: skip
    return session.scalars(query).first()


def runs_page(session: Session, *, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
    """A page of runs, newest first, each with its step count and latest numbers."""
    total = int(session.scalar(select(func.count()).select_from(TrainingRun)) or 0)
    runs = session.scalars(
        select(TrainingRun).order_by(TrainingRun.id.desc()).limit(limit).offset(offset)
    )
    rows = []
    for run in runs:
        last = repo.latest_step_metric(session, run.id)
        held = _latest_eval(session, run.id)
        n_steps = session.scalar(
            select(func.count()).select_from(StepMetric).where(StepMetric.run_id == run.id)
        )
        metrics = dict(last.metrics) if last else {}
        rows.append({
            **run_info(run), "steps": int(n_steps or 0), "last_step": last.step if last else None,
            "reward": metrics.get("reward_mean"), "gain": metrics.get("gain_mean"),
            "held_ndcg": (held.metrics or {}).get("combined_ndcg@10") if held else None,
        })  # fmt: skip
    return rows, total


def run_steps(session: Session, run_id: int) -> tuple[list[dict[str, Any]], int]:
    """The run's step metrics for its curves, at most MAX_CURVE_POINTS rows (evenly strided,
    the last step always kept); and how many steps it has."""
    where = StepMetric.run_id == run_id
    n = int(session.scalar(select(func.count()).select_from(StepMetric).where(where)) or 0)
    query = select(StepMetric.step, StepMetric.metrics, StepMetric.accepted).where(where)
    if n > MAX_CURVE_POINTS:
        stride = math.ceil(n / MAX_CURVE_POINTS)
        last = session.scalar(select(func.max(StepMetric.step)).where(where))
        query = query.where((StepMetric.step % stride == 0) | (StepMetric.step == last))
    rows = session.execute(query.order_by(StepMetric.step).limit(MAX_CURVE_POINTS + 1))
    return [{"step": s, "metrics": dict(m or {}), "accepted": a} for s, m, a in rows], n


def run_evaluations(session: Session, run_id: int) -> list[dict[str, Any]]:
    query = (
        select(Evaluation).where(Evaluation.run_id == run_id)
        .order_by(Evaluation.step, Evaluation.id).limit(MAX_EVALUATIONS)
    )  # fmt: skip
    return [_eval(e) for e in session.scalars(query)]


def _eval(e: Evaluation) -> dict[str, Any]:
    return {"step": e.step, "split": e.split, "n_queries": e.n_queries,
            "metrics": dict(e.metrics or {}), "created_at": e.created_at}  # fmt: skip


def checkpoints(session: Session, run_id: int) -> list[dict[str, Any]]:
    query = (
        select(PolicyVersion).where(PolicyVersion.run_id == run_id)
        .order_by(PolicyVersion.step, PolicyVersion.id).limit(MAX_CHECKPOINTS)
    )  # fmt: skip
    return [policy_info(p) for p in session.scalars(query)]


def credit_steps(
    session: Session, run_id: int, *, limit: int, offset: int
) -> tuple[list[tuple[int, int]], int]:
    """(step, number of credit records) of the run's steps that have records, newest first."""
    where = (CreditRecord.run_id == run_id) & CreditRecord.step.is_not(None)
    total = session.scalar(select(func.count(distinct(CreditRecord.step))).where(where))
    rows = session.execute(
        select(CreditRecord.step, func.count()).where(where).group_by(CreditRecord.step)
        .order_by(CreditRecord.step.desc()).limit(limit).offset(offset)
    )  # fmt: skip
    return [(int(s or 0), int(c)) for s, c in rows], int(total or 0)


def neighbour_steps(session: Session, run_id: int, step: int) -> tuple[int | None, int | None]:
    """The previous and next steps of the run that have credit records."""
    base = select(CreditRecord.step).where(CreditRecord.run_id == run_id)
    prev = session.scalar(
        base.where(CreditRecord.step < step).order_by(CreditRecord.step.desc()).limit(1)
    )
    nxt = session.scalar(base.where(CreditRecord.step > step).order_by(CreditRecord.step).limit(1))
    return prev, nxt


def explorer_page(
    session: Session, run_id: int, step: int, *, per_page: int, page: int
) -> tuple[list[dict[str, Any]], int]:
    """One page of a step's queries (``per_page`` query ids), each with its samples (at most
    MAX_SAMPLES_PER_QUERY); and how many queries the step has."""
    where = (CreditRecord.run_id == run_id) & (CreditRecord.step == step)
    total = int(
        session.scalar(select(func.count(distinct(CreditRecord.query_id))).where(where)) or 0
    )
    qids = list(session.scalars(
        select(CreditRecord.query_id).where(where).group_by(CreditRecord.query_id)
        .order_by(CreditRecord.query_id).limit(per_page).offset(per_page * page)
    ))  # fmt: skip
    if not qids:
        return [], total
    rows = session.scalars(
        select(CreditRecord).where(where, CreditRecord.query_id.in_(qids))
        .order_by(CreditRecord.query_id, CreditRecord.sample_index, CreditRecord.id)
        .limit(per_page * MAX_SAMPLES_PER_QUERY)
    )  # fmt: skip
    groups: dict[str, dict[str, Any]] = {}
    for row in rows:
        group = groups.setdefault(
            row.query_id, {"query_id": row.query_id, "query_text": row.query_text, "samples": []}
        )
        if len(group["samples"]) < MAX_SAMPLES_PER_QUERY:
            group["samples"].append(record_dict(row))
    return [groups[q] for q in qids if q in groups], total


def api_credits_page(
    session: Session, *, limit: int, offset: int
) -> tuple[list[dict[str, Any]], int]:
    """A page of the credit records `POST /v1/credits` stored (no run), newest first."""
    where = CreditRecord.run_id.is_(None)
    total = int(session.scalar(select(func.count()).select_from(CreditRecord).where(where)) or 0)
    rows = session.scalars(
        select(CreditRecord).where(where).order_by(CreditRecord.id.desc()).limit(limit).offset(offset)
    )  # fmt: skip
    return [record_dict(r) for r in rows], total


def _broadcast(base: dict[str, Any], table: list[float], m: int) -> list[float]:
    """The stored broadcast credit; for a record stored without it, the credit path's own
    baseline of its value table (`evaluator.shapley.broadcast`: v(N) on every action)."""
    stored = base.get("broadcast")
    if stored or m == 0 or len(table) != 2**m:
        return list(stored or [])
    return [float(v) for v in broadcast(torch.tensor(table, dtype=torch.float64), m).tolist()]


def record_dict(row: CreditRecord) -> dict[str, Any]:
    """A credit record as the explorer shows it."""
    base = row.baselines or {}
    adv = row.advantages or {}
    table = [float(v) for v in row.value_table]
    m = len(row.actions)
    return {
        "id": row.id, "run_id": row.run_id, "step": row.step, "query_id": row.query_id,
        "query_text": row.query_text, "sample_index": row.sample_index,
        "policy_version": row.policy_version, "actions": list(row.actions), "m": m,
        "format_status": row.format_status, "value_table": table,
        "v_empty": table[0] if table else None, "v_full": row.value_full,
        "phi": [float(v) for v in row.credits], "singleton": list(base.get("singleton") or []),
        "leave_one_out": list(base.get("leave_one_out") or []),
        "broadcast": _broadcast(base, table, m),
        "base": adv.get("base"), "shaped": list(adv.get("shaped") or []),
        "residual": row.efficiency_residual, "evaluator": row.evaluator_name,
        "evaluator_version": row.evaluator_version, "index_version": row.index_version,
        "embedder_version": row.embedder_version, "anchor": row.anchor_query,
        "created_at": row.created_at, "hits": None, "own": None,
        "merge": row.merge, "game": game_of(row.merge), "pool": None,
    }  # fmt: skip


def policy_info(p: PolicyVersion) -> dict[str, Any]:
    return {"id": p.id, "version": p.version, "name": p.name, "kind": p.kind, "step": p.step,
            "run_id": p.run_id, "parent_id": p.parent_id, "created_at": p.created_at,
            "path": p.path, "held_out": (p.meta or {}).get("held_out"),
            "made_on": (p.meta or {}).get("made_on"),
            "imported_from": (p.meta or {}).get("imported_from")}  # fmt: skip


def policies_page(session: Session, *, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
    total = int(session.scalar(select(func.count()).select_from(PolicyVersion)) or 0)
    rows = []
    for p in repo.list_policy_versions(session, limit=limit, offset=offset):
        info = policy_info(p)
        last = session.scalars(
            select(Evaluation).where(Evaluation.policy_version_id == p.id)
            .order_by(Evaluation.id.desc()).limit(1)
        ).first()  # fmt: skip
        info["latest_eval"] = _eval(last) if last else None
        parent = session.get(PolicyVersion, p.parent_id) if p.parent_id else None
        info["parent_version"] = parent.version if parent else None
        rows.append(info)
    return rows, total


def policy_choices(session: Session, *, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` registered policy versions as the job form lists them."""
    out = []
    for p in repo.list_policy_versions(session, limit=limit):
        where = f", run {p.run_id} step {p.step}" if p.run_id is not None else ""
        out.append({"version": p.version, "label": f"{p.version[:12]} {p.name} ({p.kind}{where})"})
    return out


def policy_detail(session: Session, version: str) -> dict[str, Any] | None:
    """One version (full hash), its lineage up to the root, children and evaluations."""
    row = repo.get_policy_version_by_version(session, version)
    if row is None:
        return None
    info = policy_info(row)
    lineage: list[dict[str, Any]] = []
    seen, cur = {row.id}, row
    while cur.parent_id is not None and len(lineage) < MAX_LINEAGE:
        parent = session.get(PolicyVersion, cur.parent_id)
        if parent is None or parent.id in seen:
            break
        lineage.append(policy_info(parent))
        seen.add(parent.id)
        cur = parent
    info["lineage"] = lineage
    info["children"] = [policy_info(c) for c in session.scalars(
        select(PolicyVersion).where(PolicyVersion.parent_id == row.id).order_by(PolicyVersion.id).limit(MAX_CHECKPOINTS)
    )]  # fmt: skip
    evals = session.scalars(
        select(Evaluation).where(Evaluation.policy_version_id == row.id)
        .order_by(Evaluation.id).limit(MAX_EVALUATIONS)
    )  # fmt: skip
    info["evaluations"] = [_eval(e) for e in evals]
    run = session.get(TrainingRun, row.run_id) if row.run_id else None
    info["run_name"] = run.name if run else None
    return info


def get_run_info(session: Session, run_id: int) -> dict[str, Any] | None:
    run = repo.get_run(session, run_id)
    return None if run is None else run_info(run)
