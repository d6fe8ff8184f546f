"""`casi report run RUN`: PNG curves and a short Markdown summary of one training run.

Read :func:`write_run_report`. Input is plain data (the run's step metrics and held-out
evaluations as dicts), so the report can be rebuilt any time from the database. Curves: reward
and gain over the query alone, held-out nDCG@10 (query alone / query + rewrites; in the pooled
game its graded pool recall beside the equal budget and keyword expansion), KL, clipped /
masked fractions, MIPU accept rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.reports.pyplot import pyplot
from policy.advantages import ShapingConfig
from policy.train_config import flat_view, stored_section

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward v(N) (train batch)", ("reward_mean", "query_alone_mean")),
    ("gain over the query alone", ("gain_mean",)),
    ("KL", ("kl/value", "mismatch/kl_k3")),
    ("clipped / masked fraction", ("ppo_clip/clip_frac", "masked_frac")),
    ("MIPU accept rate", ("accept_rate",)),
)


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in rows:
        m = r["metrics"]
        if key == "masked_frac" and "stack/kept_frac" in m:
            v: float | None = 1.0 - m["stack/kept_frac"]
        elif key == "accept_rate":
            a, j = m.get("count/mipu_accepted", 0.0), m.get("count/mipu_rejected", 0.0)
            v = a / (a + j) if a + j else None
        else:
            v = m.get(key)
        if v is not None:
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


HELDOUT_LIST = (
    "held-out nDCG@10",
    (("query_ndcg@10", "query alone"), ("combined_ndcg@10", "query + rewrites")),
)
HELDOUT_POOL = ("held-out pool recall (graded)", (
    ("query_pool_recall", "query alone, depth k"), ("combined_pool_recall", "query + rewrites"),
    ("budget_pool_recall", "equal budget: query alone, depth (m + 1)·k"),
    ("prf_pool_recall", "keyword expansion"),
))  # fmt: skip
"""The held-out panel: the list game's nDCG@10, or the pooled game's own value with its
baselines (a run's evaluations hold ``combined_pool_recall`` only in the pooled game)."""


def _pooled(evals: Sequence[dict[str, Any]]) -> bool:
    return bool(evals) and all("combined_pool_recall" in e["metrics"] for e in evals)


def _heldout_panel(evals: Sequence[dict[str, Any]]) -> tuple[str, tuple[tuple[str, str], ...]]:
    return HELDOUT_POOL if _pooled(evals) else HELDOUT_LIST


def plot_run(
    steps: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]], path: Path, title: str
) -> Path:
    """One PNG with a panel per curve (and the held-out panel when there are evaluations)."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, keys) in zip(axes.flat, PANELS, strict=False):
        for key in keys:
            xs, ys = _series(steps, key)
            if xs:
                ax.plot(xs, ys, marker=".", label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(
                0.5,
                0.5,
                "not in this preset",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
    ax = axes.flat[-1]
    heldout, curves = _heldout_panel(evals)
    for key, label in curves:
        pts = [(e["step"], e["metrics"][key]) for e in evals if key in e["metrics"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ax.set_title(heldout)
    ax.set_xlabel("step")
    if ax.lines:
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _preset_credit(cfg: dict[str, Any]) -> str:
    """The credit mode of the run's stored [advantages] section (either stored layout)."""
    return str(stored_section(cfg, "advantages").get("credit", ShapingConfig().credit))


def summary_markdown(
    run: dict[str, Any], steps: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]], png: str
) -> str:
    """A short Markdown summary: what ran, the last step, the held-out table over time."""
    cfg = flat_view(run["config"].get("train", {}))
    lines = [
        f"# Run {run['id']}: {run['name']} ({run['status']})",
        "",
        f"preset `{run['preset']}`, evaluator `{run['config'].get('evaluator', '?')}`, "
        f"credit `{cfg.get('credit') or _preset_credit(cfg)}`, anchor `{cfg.get('anchor_query')}`; "
        f"{cfg.get('steps')} steps × {cfg.get('queries')} queries × {cfg.get('samples')} samples × m={cfg.get('n_actions')}, "
        f"lr {cfg.get('lr')}, seed {cfg.get('seed')}.",
        "",
        f"![curves]({png})",
        "",
    ]
    if steps:
        last = steps[-1]["metrics"]
        lines += [f"Last step {steps[-1]['step']}: reward {last.get('reward_mean', float('nan')):.4f}, "
                  f"gain over the query {last.get('gain_mean', float('nan')):+.4f}, "
                  f"{last.get('time/step_s', float('nan')):.1f} s/step.", ""]  # fmt: skip
    if evals:
        lines += ["| step | split | queries | query nDCG@10 | query + rewrites nDCG@10 | gain | recall@100 (q+r) | well-formed |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for e in evals:
            m = e["metrics"]
            lines.append(
                f"| {e['step']} | {e['split']} | {e['n_queries']} | {m['query_ndcg@10']:.4f} | {m['combined_ndcg@10']:.4f} "
                f"| {m['gain_ndcg@10']:+.4f} | {m['combined_recall@100']:.4f} | {m['well_formed']:.0%} |"
            )
    if _pooled(evals):
        lines += ["", "The pooled game (graded recall of the pool of query + rewrites; the equal budget is "
                  "the query alone at depth (m + 1)·k):", "",
                  "| step | pool recall (q+r) | query alone, depth k | equal budget | keyword expansion "
                  "| overlap of the rewrites' lists | duplicate rate | |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for e in evals:
            m = e["metrics"]
            verdict = ("wastes its budget" if m["combined_pool_recall"] <= m["budget_pool_recall"]
                       else "beats the equal budget")  # fmt: skip
            lines.append(
                f"| {e['step']} | {m['combined_pool_recall']:.4f} | {m['query_pool_recall']:.4f} "
                f"| {m['budget_pool_recall']:.4f} | {m['prf_pool_recall']:.4f} | {m['overlap']:.4f} "
                f"| {m['duplicate_rate']:.4f} | {verdict} |"
            )
    return "\n".join(lines) + "\n"


def write_run_report(
    run: dict[str, Any],
    steps: Sequence[dict[str, Any]],
    evals: Sequence[dict[str, Any]],
    out_dir: Path,
) -> tuple[Path, Path]:
    """Write ``curves.png`` and ``summary.md`` into ``out_dir``; return both paths."""
    png = plot_run(steps, evals, out_dir / "curves.png", f"run {run['id']} — {run['name']}")
    md = out_dir / "summary.md"
    md.write_text(summary_markdown(run, steps, evals, png.name))
    return png, md
