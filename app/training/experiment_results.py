"""The experiment's results (`app.training.experiment`): ``results.json`` — per run and
evaluation step, per-seed finals, per-claim final nDCG@10 of every run (so the test can be
recomputed), the paired bootstrap of every pair of modes, compute per mode, machine — and, through
`app.training.experiment_tables`, ``table.md`` and ``ndcg.png``.

Significance (:func:`significance`): for each held-out claim, the seed-mean nDCG@10 of query +
rewrites at the final step under mode A minus the same under mode B; a paired bootstrap over
claims (:func:`evaluator.stats.paired_bootstrap`, 10,000 resamples, seeded): the 95 %
percentile CI of the mean difference and the one-sided p = P*(mean difference ≤ 0).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.training.experiment_plan import Plan, cell_key, load_per_query
from app.training.experiment_tables import (
    METRICS,
    mean_std,
    plot_curves,
    table_by_step,
    table_compute,
    table_markdown,
    table_per_seed,
    table_significance,
)
from evaluator.stats import DEFAULT_RESAMPLES, paired_bootstrap

SIGNIFICANCE_METRIC = "combined_ndcg@10"
"""What the paired test compares: held-out nDCG@10 of query + rewrites, per claim."""


def _curves(
    factory: sessionmaker[Session], plan: Plan
) -> dict[tuple[str, int], dict[int, dict[str, float]]]:
    out: dict[tuple[str, int], dict[int, dict[str, float]]] = {}
    with session_scope(factory) as session:
        for cell in plan.cells:
            if cell.run_id is None:
                continue
            evals = {
                int(e.step): dict(e.metrics)
                for e in repo.evaluations_for_run(session, cell.run_id)
                if e.step is not None
            }
            out[(cell.mode, cell.seed)] = {0: dict(plan.start_eval or {}), **evals}
    return out


def per_claim(folder: Path, plan: Plan) -> dict[str, Any]:
    """Per-claim held-out values at the final step of every finished run (and at the start):
    ``claim_ids`` (the evaluation's claims, in order), ``step``, and per metric in
    (combined, query) nDCG@10 a ``{"<mode>/seed<s>": [value per claim]}`` map."""
    steps = int(plan.config["steps"])
    start = load_per_query(folder, "start").get(0, [])
    ids = [r["query_id"] for r in start]
    out: dict[str, Any] = {"claim_ids": ids, "step": steps, "runs": {}}
    if start:
        out["start"] = {"combined_ndcg@10": [r["ndcg"][2] for r in start],
                        "query_ndcg@10": [r["ndcg"][0] for r in start]}  # fmt: skip
    for cell in plan.cells:
        rows = load_per_query(folder, cell_key(cell.mode, cell.seed)).get(steps)
        if not rows or [r["query_id"] for r in rows] != ids:
            continue
        out["runs"][f"{cell.mode}/seed{cell.seed}"] = {
            "combined_ndcg@10": [r["ndcg"][2] for r in rows],
            "query_ndcg@10": [r["ndcg"][0] for r in rows],
        }
    return out


def significance(
    plan: Plan, claims: dict[str, Any], *, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> dict[str, Any]:
    """Paired bootstrap over claims for every ordered pair of modes (A, B): the per-claim
    seed-mean of :data:`SIGNIFICANCE_METRIC` under A minus under B (seeds that finished)."""
    runs = claims.get("runs", {})
    seeds = {m: [s for s in plan.seeds if f"{m}/seed{s}" in runs] for m in plan.modes}
    means: dict[str, list[float]] = {}
    for mode, have in seeds.items():
        if have:
            cols = [runs[f"{mode}/seed{s}"][SIGNIFICANCE_METRIC] for s in have]
            means[mode] = [statistics.fmean(vals) for vals in zip(*cols, strict=True)]
    pairs = [
        {"a": a, "b": b, **paired_bootstrap(means[a], means[b], n_resamples=n_resamples, seed=seed).as_dict()}
        for a in plan.modes for b in plan.modes if a != b and a in means and b in means
    ]  # fmt: skip
    return {
        "metric": SIGNIFICANCE_METRIC, "step": claims.get("step"), "n_claims": len(claims.get("claim_ids", [])),
        "seeds": seeds, "complete": all(len(v) == len(plan.seeds) for v in seeds.values()),
        "n_resamples": n_resamples, "seed": seed, "pairs": pairs,
    }  # fmt: skip


def compute_by_mode(factory: sessionmaker[Session], plan: Plan) -> dict[str, Any]:
    """What each mode spent: steps recorded, rollouts (steps × queries × samples), actions per
    rollout, response tokens and wall time — the same config for every mode, checked here."""
    cfg = plan.config
    per_step = int(cfg["queries"]) * int(cfg["samples"])
    out: dict[str, Any] = {}
    with session_scope(factory) as session:
        for mode in plan.modes:
            steps, tokens, seconds, actions = 0, 0.0, 0.0, 0.0
            for cell in plan.cells:
                if cell.mode != mode or cell.run_id is None:
                    continue
                for row in repo.step_metrics_for_run(session, cell.run_id):
                    steps += 1
                    tokens += float(row.metrics.get("response_tokens_mean", 0.0)) * per_step
                    seconds += float(row.metrics.get("time/step_s", 0.0))
                    actions += float(row.metrics.get("actions_mean", 0.0)) * per_step
            out[mode] = {
                "steps": steps, "rollouts": steps * per_step, "rollouts_per_step": per_step,
                "actions": round(actions), "response_tokens": round(tokens), "train_s": round(seconds, 1),
            }  # fmt: skip
    return out


def write_results(factory: sessionmaker[Session], folder: Path, plan: Plan) -> dict[str, Any]:
    """results.json, table.md and ndcg.png from the stored evaluations and per-claim rows."""
    curves = _curves(factory, plan)
    final: dict[str, dict[str, tuple[float, float]]] = {}
    for mode in plan.modes:
        runs = [c for (m, _), c in curves.items() if m == mode and c]
        last = [c[max(c)] for c in runs if max(c) > 0]
        if last:
            final[mode] = {
                k: mean_std([r[k] for r in last]) for k in METRICS if all(k in r for r in last)
            }
    claims = per_claim(folder, plan)
    sig = significance(plan, claims)
    per_seed = {
        f"{m}/seed{s}": {"step": max(c), **{k: c[max(c)][k] for k in METRICS if k in c[max(c)]}}
        for (m, s), c in curves.items() if c and max(c) > 0
    }  # fmt: skip
    results = {
        "name": plan.name, "modes": plan.modes, "seeds": plan.seeds, "config": plan.config, "meta": plan.meta,
        "environment": {k: plan.meta.get(k) for k in ("retriever", "merge", "rrf_k")},
        "machine": (plan.meta.get("machines") or [None])[-1],
        "start": plan.start_eval, "final": {m: {k: list(v) for k, v in d.items()} for m, d in final.items()},
        "per_seed": per_seed, "significance": sig, "compute": compute_by_mode(factory, plan),
        "curves": {f"{m}/seed{s}": {str(k): v for k, v in c.items()} for (m, s), c in curves.items()},
        "per_claim": claims,
    }  # fmt: skip
    (folder / "results.json").write_text(json.dumps(results, indent=1))
    (folder / "table.md").write_text(
        table_markdown(plan, final) + table_per_seed(plan, per_seed) + table_significance(plan, sig)
        + table_compute(results["compute"]) + table_by_step(plan, curves)
    )  # fmt: skip
    plot_curves(curves, plan, folder / "ndcg.png")
    return results
