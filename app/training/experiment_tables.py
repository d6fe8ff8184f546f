"""The experiment's ``table.md`` and ``ndcg.png`` (`app.training.experiment_results` builds the
numbers): mean ± std over seeds per mode, a per-seed table, Shapley against each other mode
(95 % CI, one-sided p), compute per mode, held-out nDCG@10 by step, and the curves."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from app.reports.pyplot import pyplot
from app.training.experiment_plan import Plan
from policy.train_config import flat_view

METRICS = (
    "combined_ndcg@10",
    "combined_recall@100",
    "gain_ndcg@10",
    "gain_recall@100",
    "well_formed",
)


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


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
    meta, cfg = plan.meta, flat_view(plan.config)
    machine = (meta.get("machines") or [{}])[-1]
    rrf = f" (k = {meta.get('rrf_k')})" if meta.get("merge") == "rrf" else ""
    return (
        f"Environment: retriever {meta.get('retriever', 'dense')}, merge {meta.get('merge', 'max')}{rrf}, "
        f"anchor {'on' if cfg.get('anchor_query', True) else 'off'}, format {cfg.get('format')}, "
        f"line cap {cfg.get('line_cap')}, sampler {cfg.get('precision')}; held-out rewrites greedy float32. "
        f"Machine: {machine.get('cpu_model', '?')} ({', '.join(machine.get('isa_flags', []))}; "
        f"torch {machine.get('torch_cpu_capability', '?')}), {machine.get('cpu_count', '?')} cores"
        + (f", GPU {machine['gpu']}" if machine.get("gpu") else "")
        + "".join(f", {k}={v}" for k, v in sorted((machine.get("kernel_env") or {}).items()))
        + "."
    )


def table_markdown(plan: Plan, final: dict[str, dict[str, tuple[float, float]]]) -> str:
    cfg, start = flat_view(plan.config), plan.start_eval or {}
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
            out[mode] = {s: mean_std([c[s]["combined_ndcg@10"] for c in runs]) for s in common}
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
    plt = pyplot()
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
