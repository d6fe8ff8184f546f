"""`casi experiment credit`: the credit-mode experiment, resumable, with a table, a plot and JSON.

Read :func:`run_experiment`. Every (mode, seed) cell trains from the SAME starting policy with
the same config except the credit mode: same seeds, so the same data order and the same first
rollouts; every run is evaluated on the same held-out claims (the starting policy once, shared
by all cells). The plan — cells and their run ids — lives in ``var/experiments/<name>/plan.json``,
written before each run starts: a killed experiment skips finished cells and resumes the
interrupted one exactly (`resume_run`). Results: ``results.json`` (per run, per evaluation
step), ``table.md`` (mean ± std over seeds per mode) and ``ndcg.png`` (held-out nDCG@10 of
query + rewrites against steps, one line per mode, the query-alone level dashed).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.services.train import open_run, resume_run, run_training
from policy.train_config import TrainConfig

METRICS = (
    "combined_ndcg@10",
    "combined_recall@100",
    "gain_ndcg@10",
    "gain_recall@100",
    "well_formed",
)


@dataclass
class Cell:
    mode: str
    seed: int
    run_id: int | None = None
    done: bool = False


@dataclass
class Plan:
    name: str
    modes: list[str]
    seeds: list[int]
    config: dict[str, Any]  # the TrainConfig (credit and seed set per cell)
    meta: dict[str, Any]  # policy ref, evaluator, index slice
    cells: list[Cell] = field(default_factory=list)
    start_eval: dict[str, float] | None = None  # the starting policy, evaluated once

    def save(self, path: Path) -> None:
        data = {**self.__dict__, "cells": [c.__dict__ for c in self.cells]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Plan:
        data = json.loads(path.read_text())
        data["cells"] = [Cell(**c) for c in data["cells"]]
        return cls(**data)


def make_plan(
    folder: Path,
    name: str,
    modes: list[str],
    seeds: list[int],
    cfg: TrainConfig,
    meta: dict[str, Any],
) -> Plan:
    """A new plan, or the stored one (a restart must ask for the same experiment)."""
    path = folder / "plan.json"
    if path.is_file():
        plan = Plan.load(path)
        if plan.modes != modes or plan.seeds != seeds:
            raise ValueError(
                f"experiment {name!r} exists with modes {plan.modes} and seeds {plan.seeds}: use another --name"
            )
        return plan
    folder.mkdir(parents=True, exist_ok=True)
    plan = Plan(name, modes, seeds, cfg.to_dict(), meta, [Cell(m, s) for s in seeds for m in modes])
    plan.save(path)
    return plan


def run_experiment(
    factory: sessionmaker[Session],
    var_dir: Path,
    folder: Path,
    plan: Plan,
    build: Callable[[], Any],
    *,
    on_cell: Callable[[Cell, int, int], None] | None = None,
    on_step: Callable[[Any], None] | None = None,
    on_eval: Callable[[int, Any], None] | None = None,
) -> dict[str, Any]:
    """Run (or finish) every cell. ``build()`` returns (retrieval, scorer, policy, eval request,
    restore) once; ``restore()`` puts the starting weights back before each cell."""
    retrieval, scorer, policy, request, restore = build()
    path = folder / "plan.json"
    if plan.start_eval is None:
        from policy.evaluate import evaluate_policy

        c = request
        plan.start_eval = evaluate_policy(
            policy.model, policy.tokenizer, c.queries, c.executor, c.ndcg, c.recall, c.config
        ).metrics
        plan.save(path)
    for i, cell in enumerate(plan.cells):
        if cell.done:
            continue
        if on_cell is not None:
            on_cell(cell, i, len(plan.cells))
        restore()
        if cell.run_id is None:
            cfg = TrainConfig.from_dict({**plan.config, "credit": cell.mode, "seed": cell.seed})
            handle = open_run(
                factory, var_dir, cfg, policy, f"{plan.name}-{cell.mode}-s{cell.seed}", plan.meta
            )
            handle.skip_start_eval = True
            cell.run_id = handle.run_id
            plan.save(path)
        else:
            handle, cfg, _ = resume_run(factory, var_dir, cell.run_id)
            handle.skip_start_eval = True
        run_training(
            factory,
            retrieval,
            scorer,
            policy,
            cfg,
            handle,
            request,
            on_step=on_step,
            on_eval=on_eval,
        )
        cell.done = True
        plan.save(path)
    return write_results(factory, folder, plan)


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


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def write_results(factory: sessionmaker[Session], folder: Path, plan: Plan) -> dict[str, Any]:
    """results.json, table.md and ndcg.png from the stored evaluations."""
    curves = _curves(factory, plan)
    final: dict[str, dict[str, tuple[float, float]]] = {}
    for mode in plan.modes:
        runs = [c for (m, _), c in curves.items() if m == mode and c]
        last = [c[max(c)] for c in runs if max(c) > 0]
        if last:
            final[mode] = {
                k: _mean_std([r[k] for r in last]) for k in METRICS if all(k in r for r in last)
            }
    results = {
        "name": plan.name, "modes": plan.modes, "seeds": plan.seeds, "config": plan.config, "meta": plan.meta,
        "start": plan.start_eval, "final": {m: {k: list(v) for k, v in d.items()} for m, d in final.items()},
        "curves": {f"{m}/seed{s}": {str(k): v for k, v in c.items()} for (m, s), c in curves.items()},
    }  # fmt: skip
    (folder / "results.json").write_text(json.dumps(results, indent=1))
    (folder / "table.md").write_text(table_markdown(plan, final) + table_by_step(plan, curves))
    plot_curves(curves, plan, folder / "ndcg.png")
    return results


def table_markdown(plan: Plan, final: dict[str, dict[str, tuple[float, float]]]) -> str:
    cfg, start = plan.config, plan.start_eval or {}
    lines = [
        f"Held-out: {cfg.get('eval_queries')} {cfg.get('eval_split')} claims after {cfg.get('steps')} steps "
        f"({cfg.get('queries')} queries × {cfg.get('samples')} samples × m={cfg.get('n_actions')}, lr {cfg.get('lr')}), "
        f"mean ± std over seeds {plan.seeds}. Starting policy: query alone nDCG@10 {start.get('query_ndcg@10', float('nan')):.4f}, "
        f"query + rewrites {start.get('combined_ndcg@10', float('nan')):.4f}.",
        "",
        "| credit | nDCG@10 (query + rewrites) | recall@100 (query + rewrites) | gain nDCG@10 over query | gain recall@100 | well-formed |",
        "|---|---|---|---|---|---|",
    ]
    for mode in plan.modes:
        if mode not in final:
            lines.append(f"| {mode} | (not run yet) | | | | |")
            continue
        f = final[mode]
        cells = [f"{f[k][0]:.4f} ± {f[k][1]:.4f}" if k in f else "—" for k in METRICS[:4]]
        wf = f"{f['well_formed'][0]:.0%}" if "well_formed" in f else "—"
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {wf} |")
    return "\n".join(lines) + "\n"


def _by_step(
    plan: Plan, curves: dict[tuple[str, int], dict[int, dict[str, float]]], min_evals: int = 1
) -> dict[str, dict[int, tuple[float, float]]]:
    """Per mode: held-out nDCG@10 of query + rewrites (mean, std over the seeds with at least
    ``min_evals`` evaluations) at every step all of those seeds have reached."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for mode in plan.modes:
        runs = [c for (m, _), c in curves.items() if m == mode and len(c) >= min_evals]
        if runs:
            common = sorted(set.intersection(*(set(c) for c in runs)))
            out[mode] = {s: _mean_std([c[s]["combined_ndcg@10"] for c in runs]) for s in common}
    return out


def table_by_step(plan: Plan, curves: dict[tuple[str, int], dict[int, dict[str, float]]]) -> str:
    """Held-out nDCG@10 of query + rewrites at every evaluated step (mean ± std over seeds):
    which credit gets there faster."""
    rows = _by_step(plan, curves)
    steps = sorted(set().union(*(set(r) for r in rows.values()))) if rows else []
    if not steps:
        return ""
    head = " | ".join("start" if s == 0 else f"step {s}" for s in steps)
    lines = [
        "",
        "Held-out nDCG@10 of query + rewrites by training step (mean ± std over seeds):",
        "",
        f"| credit | {head} |",
        "|---|" + "---|" * len(steps),
    ]
    for mode, by_step in rows.items():
        cells = [
            f"{by_step[s][0]:.4f} ± {by_step[s][1]:.4f}" if s in by_step else "—" for s in steps
        ]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(
    curves: dict[tuple[str, int], dict[int, dict[str, float]]], plan: Plan, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    seeds = {
        mode: sum(m == mode and len(c) > 1 for (m, _), c in curves.items()) for mode in plan.modes
    }
    for mode, by_step in _by_step(plan, curves, min_evals=2).items():
        steps, stats = list(by_step), list(by_step.values())
        means = [m for m, _ in stats]
        (line,) = ax.plot(steps, means, marker="o", label=f"{mode} (n={seeds[mode]}, ± std)")
        ax.fill_between(
            steps, [m - d for m, d in stats], [m + d for m, d in stats],
            color=line.get_color(), alpha=0.12,
        )  # fmt: skip
    if plan.start_eval:
        ax.axhline(
            plan.start_eval["query_ndcg@10"], color="gray", linestyle="--", label="query alone"
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out nDCG@10, query + rewrites")
    ax.set_title(f"credit-mode experiment {plan.name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
