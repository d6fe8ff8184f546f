"""Which curves a run page draws, from the stored step metrics and held-out evaluations, and the
credit explorer's per-sample figures (sorted value table, interaction matrix).

Metric names are the trainer's (`policy/trainer.py`) and the held-out evaluation's
(`policy/evaluate.py`); the masked fraction and MIPU accept rate are derived exactly as
`casi report run` derives them (:func:`app.reports.run._series`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from app.reports.run import _series
from app.ui.svg import Series, interaction_matrix, line_chart, value_bars
from evaluator.shapley import shapley_interaction

# (chart id, title, [(series label, step-metric key)])
STEP_CURVES: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("reward", "reward v(N), train batch", (("reward", "reward_mean"), ("query alone", "query_alone_mean"))),
    ("gain", "gain over the query alone", (("gain", "gain_mean"),)),
    ("kl", "KL", (("KL to reference", "kl/value"), ("KL(μ‖π_old)", "mismatch/kl_k3"))),
    ("clip", "clipped / masked fraction", (("clipped", "ppo_clip/clip_frac"), ("masked", "masked_frac"))),
    ("format", "well-formed fraction", (("train rollouts", "format_ok_fraction"),)),
    ("accept", "MIPU accept rate", (("accept rate", "accept_rate"),)),
    ("time", "seconds per step", (("s / step", "time/step_s"),)),
)  # fmt: skip
LISTS = (("query", "query"), ("rewrites", "rewrites"), ("query + rewrites", "combined"))
EVAL_CURVES = (
    ("heldout-ndcg", "held-out nDCG@10", "ndcg@10"),
    ("heldout-recall", "held-out recall@100", "recall@100"),
)
# One curve per run when several runs are overlaid.
OVERLAY = (
    ("reward", "reward v(N)", "reward_mean"),
    ("gain", "gain over the query", "gain_mean"),
    ("kl", "KL(μ‖π_old)", "mismatch/kl_k3"),
    ("format", "well-formed fraction", "format_ok_fraction"),
    ("time", "seconds per step", "time/step_s"),
)


def _eval_series(evals: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(float(e["step"]), float(e["metrics"][key])) for e in evals
           if e["step"] is not None and key in e["metrics"]]  # fmt: skip
    return [x for x, _ in pts], [y for _, y in pts]


def _clip_key(steps: Sequence[dict[str, Any]]) -> str:
    """The clip fraction of whichever pg term the preset used (ppo_clip, cispo, …)."""
    for row in steps[-1:]:
        for k in row["metrics"]:
            if k.endswith("clip_frac") and not k.startswith("shaping"):
                return str(k)
    return "ppo_clip/clip_frac"


def run_charts(steps: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]]) -> list[str]:
    """Every curve of one run, as inline SVG."""
    out = []
    clip = _clip_key(steps)
    for chart_id, title, keys in STEP_CURVES:
        series = []
        for label, key in keys:
            xs, ys = _series(steps, clip if key == "ppo_clip/clip_frac" else key)
            series.append(Series(label, xs, ys))
        if chart_id == "format":
            series.append(Series("held-out", *_eval_series(evals, "well_formed")))
        out.append(line_chart(series, title=title, chart_id=f"chart-{chart_id}"))
    for chart_id, title, suffix in EVAL_CURVES:
        series = [Series(label, *_eval_series(evals, f"{name}_{suffix}")) for label, name in LISTS]
        out.insert(
            2 if chart_id == "heldout-ndcg" else 3,
            line_chart(series, title=title, chart_id=f"chart-{chart_id}"),
        )
    return out


def overlay_charts(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Several runs on shared axes, one curve per run (``runs``: info + steps + evals)."""

    def label(r: dict[str, Any]) -> str:
        return f"run {r['id']} {r['name']} ({r['credit']})"

    out = [
        line_chart([Series(label(r), *_series(r["steps"], key)) for r in runs], title=title,
                   chart_id=f"overlay-{chart_id}")
        for chart_id, title, key in OVERLAY
    ]  # fmt: skip
    out.insert(2, line_chart(
        [Series(label(r), *_eval_series(r["evals"], "combined_ndcg@10")) for r in runs],
        title="held-out nDCG@10, query + rewrites", chart_id="overlay-heldout",
    ))  # fmt: skip
    return out


def sample_figures(rec: dict[str, Any]) -> dict[str, str]:
    """The sorted value table and (m ≥ 2) the pairwise interaction matrix of one record, the
    matrix computed from the stored v(S) by `evaluator.shapley.shapley_interaction`."""
    m, values = rec["m"], rec["value_table"]
    figs = {"bars": value_bars(values, m, chart_id=f"bars-{rec['id']}")} if values else {}
    if m >= 2 and len(values) == 2**m:
        matrix = shapley_interaction(torch.tensor(values, dtype=torch.float64), m).tolist()
        figs["matrix"] = interaction_matrix(matrix, chart_id=f"matrix-{rec['id']}")
    return figs


def token_advantages(rec: dict[str, Any], lam: float) -> list[float | None]:
    """A + λ·x_j of each rewrite's tokens (None where the record has no base advantage A)."""
    base = rec["base"]
    return [None if base is None else float(base) + lam * float(x) for x in rec["shaped"]]
