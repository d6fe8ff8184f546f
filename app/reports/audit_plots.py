"""The audit report's figures as inline SVG (matplotlib, Agg, text as paths: no fonts, no
external assets). Each function takes the report JSON and returns one ``<svg>`` string.

Read :func:`agreement_by_size` first: sign agreement per coalition size with its bootstrap
interval and the threshold — the one picture that carries the verdict.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from app.reports.pyplot import pyplot

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NO_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}
"""No RDF block: the figure is byte-stable and names no outside URL."""
PASS, FAIL, GREY = "#2e7d32", "#c62828", "#9e9e9e"
SIZE_COLOURS = ("#1565c0", "#6a1b9a", "#ef6c00", "#00838f", "#ad1457", "#558b2f")


def _svg(fig: Figure, salt: str) -> str:
    """The figure as an inline ``<svg>``; ``salt`` keeps element ids distinct across figures."""
    plt = pyplot()
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "path", "svg.hashsalt": f"casi-{salt}"}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata=NO_METADATA)
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog and DOCTYPE (inline in HTML)


def _or(x: float | None, default: float) -> float:
    return default if x is None else x


def agreement_by_size(report: dict[str, Any]) -> str:
    """Bars: agree_k per size k with the CI as error bars; dashed line: the threshold."""
    plt = pyplot()
    rows = [r for r in report["sizes"] if r["has_pairs"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ks = [r["k"] for r in rows]
    agree = [r["agree"] for r in rows]
    err = [  # a few resamples can leave the estimate outside its interval: no negative bar
        [max(0.0, r["agree"] - _or(r["ci_low"], r["agree"])) for r in rows],
        [max(0.0, _or(r["ci_high"], r["agree"]) - r["agree"]) for r in rows],
    ]
    colours = [PASS if r["passed"] else FAIL for r in rows]
    ax.bar(ks, agree, color=colours, width=0.6, yerr=err, capsize=6, ecolor="#212121")
    ax.axhline(report["config"]["threshold"], color="#212121", linestyle="--", linewidth=1)
    for k, a in zip(ks, agree, strict=True):
        ax.text(k, 0.03, f"{a:.2f}", ha="center", color="white", fontsize=10, fontweight="bold")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(ks, [f"{k}" for k in ks])
    ax.set_xlabel("coalition size k = |S ∪ {j}|")
    ax.set_ylabel("marginal sign agreement")
    level = int(round(100 * report["config"]["level"]))
    ax.set_title(f"Agreement by size ({level} % CI, queries resampled); dashed = threshold")
    return _svg(fig, "agreement_by_size")


def delta_scatter(report: dict[str, Any]) -> str:
    """Δ_train vs Δ_reference of sampled marginals, by size; shaded = same-sign quadrants."""
    plt = pyplot()
    sc = report["scatter"]
    fig, ax = plt.subplots(figsize=(5.6, 4.6))
    xs, ys, sizes = sc["delta_reference"], sc["delta_train"], sc["size"]
    lim = max([1e-3, *(abs(v) for v in xs + ys)]) * 1.05
    ax.fill_between([0, lim], 0, lim, color=PASS, alpha=0.08, linewidth=0)
    ax.fill_between([-lim, 0], -lim, 0, color=PASS, alpha=0.08, linewidth=0)
    for k in sorted({int(s) for s in sizes}):
        pick = [i for i, s in enumerate(sizes) if int(s) == k]
        ax.scatter(
            [xs[i] for i in pick], [ys[i] for i in pick], s=9, alpha=0.55,
            color=SIZE_COLOURS[(k - 1) % len(SIZE_COLOURS)], label=f"size {k}",
        )  # fmt: skip
    ax.axhline(0, color=GREY, linewidth=0.8)
    ax.axvline(0, color=GREY, linewidth=0.8)
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_xlabel(f"Δ {report['reference_evaluator']['name']} (reference)")
    ax.set_ylabel(f"Δ {report['train_evaluator']['name']} (training)")
    ax.set_title(f"Marginal contributions v(S∪{{j}}) − v(S), {len(xs)} sampled")
    if xs:
        ax.legend(loc="upper left", fontsize=8, markerscale=2)
    return _svg(fig, "delta_scatter")


def phi_agreement(report: dict[str, Any]) -> str:
    """Left: φ_train vs φ_reference per action; right: φ sign agreement, Kendall τ, top action."""
    plt = pyplot()
    sc, phi = report["scatter"], report["phi"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.8), width_ratios=(1.1, 1))
    xs, ys = sc["phi_reference"], sc["phi_train"]
    left.scatter(xs, ys, s=9, alpha=0.5, color=SIZE_COLOURS[0])
    left.axhline(0, color=GREY, linewidth=0.8)
    left.axvline(0, color=GREY, linewidth=0.8)
    left.set_xlabel(f"φ {report['reference_evaluator']['name']}")
    left.set_ylabel(f"φ {report['train_evaluator']['name']}")
    left.set_title("Shapley credit per action")
    names = ("sign_agree", "kendall_tau", "top_agree")
    labels = ("φ sign\nagreement", "mean Kendall τ_b\nper rollout", "top action\nagreement")
    vals = [_or(phi[n]["estimate"], 0.0) for n in names]
    err = [
        [max(0.0, v - _or(phi[n]["ci_low"], v)) for v, n in zip(vals, names, strict=True)],
        [max(0.0, _or(phi[n]["ci_high"], v) - v) for v, n in zip(vals, names, strict=True)],
    ]
    right.bar(range(3), vals, yerr=err, capsize=6, color=SIZE_COLOURS[1], width=0.6)
    for i, v in enumerate(vals):
        right.text(i, 0.03 if v >= 0.12 else v + 0.03, f"{v:.2f}", ha="center", fontsize=10,
                   color="white" if v >= 0.12 else "#212121", fontweight="bold")  # fmt: skip
    right.axhline(0, color=GREY, linewidth=0.8)
    right.set_xticks(range(3), labels, fontsize=8)
    right.set_ylim(min(-0.1, min(vals) - 0.15), 1.1)
    right.set_title("Agreement of φ")
    fig.tight_layout()
    return _svg(fig, "phi_agreement")


def cheap_credit(report: dict[str, Any]) -> str:
    """How often singleton / leave-one-out rank a rollout's actions differently from Shapley
    (reference evaluator), by m."""
    plt = pyplot()
    rows = report["cheap_credit"]["reference"]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ms = [r["m"] for r in rows]
    width = 0.38
    for off, name, colour in (
        (-width / 2, "singleton", "#ef6c00"),
        (width / 2, "leave_one_out", "#00838f"),
    ):
        ax.bar(
            [m + off for m in ms], [r[f"{name}_rank_differs"] for r in rows], width=width,
            color=colour, label=name.replace("_", "-"),
        )  # fmt: skip
    ax.set_ylim(0, 1.02)
    ax.set_xticks(ms, [f"m = {m}" for m in ms])
    ax.set_ylabel("rollouts ranked differently")
    ax.set_title(f"Cheap credit vs Shapley ({report['reference_evaluator']['name']})")
    if rows:
        ax.legend(fontsize=8)
    return _svg(fig, "cheap_credit")
