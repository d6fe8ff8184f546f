"""`casi experiment credit`: the credit-mode experiment, resumable, with tables, a plot and JSON.

Read :func:`run_experiment`. Every (mode, seed) cell trains from the SAME starting policy with
the same config except the credit mode: same seeds, so the same data order and the same first
rollouts, and the same compute (steps × queries × samples rollouts of m actions each); every
run is evaluated on the same held-out claims, through the ONE held-out path
(:func:`app.services.evaluate.evaluate_and_store`: greedy, float32) that `casi eval` and
`casi train` use — the starting policy once, shared by all cells, stored as an evaluation of
its version. The plan — cells and their run ids, the retrieval environment (retriever, merge
rule) and the machines it ran on — lives in ``var/experiments/<name>/plan.json``, written
before each run starts: a killed experiment skips finished cells and resumes the interrupted
one exactly (`resume_run`). Every evaluation's per-claim rows land in
``per_query/<mode>-s<seed>.json`` (``start.json`` for the start) as it happens.

Results: ``results.json`` (per run, per evaluation step; per-seed finals; per-claim final nDCG@10
of every run, so the significance test can be recomputed; the paired bootstrap of every pair of
modes; compute per mode; machine), ``table.md`` (mean ± std over seeds per mode, a per-seed
table, Shapley vs each other mode with a 95 % CI and a one-sided p, the by-step table) and
``ndcg.png`` (held-out nDCG@10 of query + rewrites against steps, one line per mode, the
query-alone level dashed).

Significance (:func:`significance`): for each held-out claim, the seed-mean nDCG@10 of query +
rewrites at the final step under mode A minus the same under mode B; a paired bootstrap over
claims (:func:`evaluator.stats.paired_bootstrap`, 10,000 resamples, seeded): the 95 %
percentile CI of the mean difference and the one-sided p = P*(mean difference ≤ 0).
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
from app.services.evaluate import evaluate_and_store, machine_info
from app.services.train import open_run, resume_run, run_training
from evaluator.stats import DEFAULT_RESAMPLES, paired_bootstrap
from policy.train_config import TrainConfig

METRICS = (
    "combined_ndcg@10",
    "combined_recall@100",
    "gain_ndcg@10",
    "gain_recall@100",
    "well_formed",
)
SIGNIFICANCE_METRIC = "combined_ndcg@10"
"""What the paired test compares: held-out nDCG@10 of query + rewrites, per claim."""
ENVIRONMENT = ("policy", "evaluator", "retriever", "merge", "rrf_k")
"""Meta keys a resumed experiment must share with the stored one."""


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


def _plain(obj: Any) -> Any:
    """``obj`` as stored JSON reads back (tuples become lists)."""
    return json.loads(json.dumps(obj))


def make_plan(
    folder: Path,
    name: str,
    modes: list[str],
    seeds: list[int],
    cfg: TrainConfig,
    meta: dict[str, Any],
) -> Plan:
    """A new plan, or the stored one (a restart must ask for the same experiment: the same
    modes, seeds, training config and environment)."""
    path = folder / "plan.json"
    if path.is_file():
        plan = Plan.load(path)
        if plan.modes != modes or plan.seeds != seeds:
            raise ValueError(
                f"experiment {name!r} exists with modes {plan.modes} and seeds {plan.seeds}: use another --name"
            )
        wanted = _plain(cfg.to_dict())
        changed = sorted(
            k for k in set(wanted) | set(plan.config) if wanted.get(k) != plan.config.get(k)
        )
        changed += [
            k
            for k in ENVIRONMENT
            if k in meta and k in plan.meta and _plain(meta[k]) != plan.meta[k]
        ]
        if changed:
            raise ValueError(
                f"experiment {name!r} exists with other settings ({', '.join(changed)}): "
                "rerun its command unchanged to resume it, or use another --name"
            )
        return plan
    folder.mkdir(parents=True, exist_ok=True)
    plan = Plan(name, modes, seeds, cfg.to_dict(), meta, [Cell(m, s) for s in seeds for m in modes])
    plan.save(path)
    return plan


def cell_key(mode: str, seed: int) -> str:
    return f"{mode}-s{seed}"


def _per_query_path(folder: Path, key: str) -> Path:
    return folder / "per_query" / f"{key}.json"


def load_per_query(folder: Path, key: str) -> dict[int, list[dict[str, Any]]]:
    """The per-claim rows of every stored evaluation of ``key`` (a cell, or ``start``), by step."""
    path = _per_query_path(folder, key)
    if not path.is_file():
        return {}
    return {int(k): v for k, v in json.loads(path.read_text()).items()}


def _write_per_query(folder: Path, key: str, by_step: dict[int, list[dict[str, Any]]]) -> None:
    path = _per_query_path(folder, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(k): v for k, v in sorted(by_step.items())}))
    tmp.replace(path)


def save_per_query(folder: Path, key: str, step: int, rows: list[dict[str, Any]]) -> None:
    """Store one evaluation's per-claim rows (atomic: a kill leaves the old file or the new)."""
    by_step = load_per_query(folder, key)
    by_step[step] = rows
    _write_per_query(folder, key, by_step)


def _drop_per_query_after(folder: Path, key: str, step: int) -> None:
    """A resumed cell recomputes every step after ``step``: drop their rows (as the database
    rows are dropped), so what is stored is what the finished run evaluated."""
    by_step = load_per_query(folder, key)
    if any(s > step for s in by_step):
        _write_per_query(folder, key, {s: v for s, v in by_step.items() if s <= step})


def _record_machine(plan: Plan) -> None:
    """Every machine the experiment ran on (a resume may be elsewhere), in order."""
    machines = plan.meta.setdefault("machines", [])
    here = _plain(machine_info())
    if not machines or machines[-1] != here:
        machines.append(here)


def _start_version_id(factory: sessionmaker[Session], policy: Any) -> int:
    """The starting policy's registered version (what its start evaluation belongs to)."""
    with session_scope(factory) as session:
        return repo.get_or_add_policy_version(
            session, version=policy.version, name=policy.name, base_model=policy.base_model,
            path=policy.path, kind=policy.kind,
        ).id  # fmt: skip


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
    _record_machine(plan)
    plan.save(path)
    if plan.start_eval is None:  # the one held-out path, stored as an evaluation of the start
        result = evaluate_and_store(
            factory, policy.model, policy.tokenizer, request,
            policy_version_id=_start_version_id(factory, policy),
        )  # fmt: skip
        save_per_query(folder, "start", 0, result.per_query)
        plan.start_eval = result.metrics
        plan.save(path)
    for i, cell in enumerate(plan.cells):
        if cell.done:
            continue
        if on_cell is not None:
            on_cell(cell, i, len(plan.cells))
        restore()
        key = cell_key(cell.mode, cell.seed)
        if cell.run_id is None:
            cfg = TrainConfig.from_dict({**plan.config, "credit": cell.mode, "seed": cell.seed})
            handle = open_run(
                factory, var_dir, cfg, policy, f"{plan.name}-{cell.mode}-s{cell.seed}", plan.meta
            )
            cell.run_id = handle.run_id
            plan.save(path)
        else:
            handle, cfg, _ = resume_run(factory, var_dir, cell.run_id)
        handle.skip_start_eval = True
        _drop_per_query_after(folder, key, handle.start_step)

        def evaluated(step: int, result: Any, key: str = key) -> None:
            save_per_query(folder, key, step, result.per_query)
            if on_eval is not None:
                on_eval(step, result)

        run_training(
            factory, retrieval, scorer, policy, cfg, handle, request,
            on_step=on_step, on_eval=evaluated,
        )  # fmt: skip
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
                k: _mean_std([r[k] for r in last]) for k in METRICS if all(k in r for r in last)
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


def table_per_seed(plan: Plan, per_seed: dict[str, dict[str, Any]]) -> str:
    """Final held-out nDCG@10 of query + rewrites of every (mode, seed) run."""
    if not per_seed:
        return ""
    steps = int(plan.config["steps"])
    head = " | ".join(f"seed {s}" for s in plan.seeds)
    lines = ["", f"Per seed: held-out nDCG@10 of query + rewrites at step {steps} "
             "(a step in brackets: the run's last evaluation so far):", "",
             f"| credit | {head} |", "|---|" + "---|" * len(plan.seeds)]  # fmt: skip
    for mode in plan.modes:
        cells = []
        for s in plan.seeds:
            r = per_seed.get(f"{mode}/seed{s}")
            cells.append("—" if r is None else f"{r['combined_ndcg@10']:.4f}"
                         + ("" if r["step"] == steps else f" (step {r['step']})"))  # fmt: skip
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def table_significance(plan: Plan, sig: dict[str, Any], reference: str = "shapley") -> str:
    """``reference`` (Shapley) against each other mode: mean per-claim difference, 95 % CI, p."""
    rows = [p for p in sig["pairs"] if p["a"] == reference]
    if not rows:
        return ""
    partial = "" if sig["complete"] else " — PARTIAL: not every seed has finished"
    lines = [
        "",
        f"Paired test over {sig['n_claims']} held-out claims ({reference} − other; per claim the "
        f"seed-mean nDCG@10 of query + rewrites at step {sig['step']}; paired bootstrap, "
        f"{sig['n_resamples']:,} resamples; p = one-sided P*(difference ≤ 0)){partial}:",
        "",
        f"| {reference} vs | seeds | mean difference | 95 % CI | p (one-sided) |",
        "|---|---|---|---|---|",
    ]
    for p in rows:
        n = f"{len(sig['seeds'][p['a']])} vs {len(sig['seeds'][p['b']])}"
        lines.append(
            f"| {p['b']} | {n} | {p['mean_diff']:+.4f} | [{p['ci_low']:+.4f}, {p['ci_high']:+.4f}] | {p['p_one_sided']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def table_compute(compute: dict[str, Any]) -> str:
    """Compute per mode (equal by construction: the same steps and rollouts per step)."""
    if not compute:
        return ""
    lines = ["", "Compute per mode (all seeds):", "",
             "| credit | steps | rollouts | actions | response tokens | train time (s) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for mode, c in compute.items():
        lines.append(
            f"| {mode} | {c['steps']} | {c['rollouts']} | {c['actions']} | {c['response_tokens']} | {c['train_s']} |"
        )
    return "\n".join(lines) + "\n"


def _environment_line(plan: Plan) -> str:
    meta, cfg = plan.meta, plan.config
    machine = (meta.get("machines") or [{}])[-1]
    rrf = f" (k = {meta.get('rrf_k')})" if meta.get("merge") == "rrf" else ""
    return (
        f"Environment: retriever {meta.get('retriever', 'dense')}, merge {meta.get('merge', 'max')}{rrf}, "
        f"anchor {'on' if cfg.get('anchor_query', True) else 'off'}, format {cfg.get('format')}, "
        f"line cap {cfg.get('line_cap')}, sampler {cfg.get('precision')}; held-out rewrites greedy float32. "
        f"Machine: {machine.get('cpu_model', '?')} ({', '.join(machine.get('isa_flags', []))}; "
        f"torch {machine.get('torch_cpu_capability', '?')}), {machine.get('cpu_count', '?')} cores"
        + (f", GPU {machine['gpu']}" if machine.get("gpu") else "")
        + "."
    )


def table_markdown(plan: Plan, final: dict[str, dict[str, tuple[float, float]]]) -> str:
    cfg, start = plan.config, plan.start_eval or {}
    lines = [
        f"Held-out: {cfg.get('eval_queries')} {cfg.get('eval_split')} claims after {cfg.get('steps')} steps "
        f"({cfg.get('queries')} queries × {cfg.get('samples')} samples × m={cfg.get('n_actions')}, lr {cfg.get('lr')}), "
        f"mean ± std over seeds {plan.seeds}. Starting policy: query alone nDCG@10 {start.get('query_ndcg@10', float('nan')):.4f}, "
        f"query + rewrites {start.get('combined_ndcg@10', float('nan')):.4f}.",
        "",
        _environment_line(plan),
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
