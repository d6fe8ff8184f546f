"""How `casi experiment aggregate` shows its answer: ``table.md`` and ``ndcg.png``.

`app.experiments.aggregate` reads and checks the committed cells and computes the answer (per
mode, per seed, every pre-registered hypothesis); :func:`markdown` and :func:`plot` render that
answer, and nothing here reads a file or computes a statistic beyond a mean. The labels of the
compared metric, the secondary columns, the pooled game's baselines and its mechanism numbers
live here, with the tables that show them.
"""

from __future__ import annotations

import io
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from app.experiments.protocol import Protocol
from app.experiments.results_folder import EnvCells
from app.reports.pyplot import pyplot

PNG_METADATA = {"Software": None}  # no library version in the bytes
METRIC_LABELS = {
    "ndcg@10": ("nDCG@10 (query + rewrites)", "held-out nDCG@10, query + rewrites"),
    "pool_recall": ("pool recall (query + rewrites)", "held-out graded recall of the pool"),
    "overlap": ("overlap between the rewrites' lists", "held-out overlap of the rewrites' lists"),
}
"""(table, plot) labels of a compared metric; a metric not listed is shown by its key."""
SECONDARY = (
    ("served nDCG@10", ("served_ndcg@10", "ndcg@10")),
    ("overlap", ("overlap",)),
    ("recall@100", ("recall@100",)),
)
"""The columns the per-mode table shows beside the compared metric: (label, its per-claim keys;
the first every cell holds is shown, :func:`first_held`). The served list is the pool re-ranked
by the second stage (``served_ndcg@10``) in the cells that hold it; in older cells it was the
fused head (``ndcg@10``)."""
SECONDARY_LABELS = {key: label for label, keys in SECONDARY for key in keys}
BASELINES = (
    ("query_pool_recall", (), "the query alone, depth k (v(∅))"),
    ("budget_recall", (), "equal budget: the query alone, depth (m + 1)·k"),
    ("prf_recall", ("prf_served_ndcg@10", "prf_ndcg@10"), "keyword expansion (PRF keywords, m rewrites)"),
    ("pool_recall", ("served_ndcg@10", "ndcg@10"), "the start: query + its rewrites"),
)  # fmt: skip
"""The pooled game's baselines, read off the start files (policy-free but the last row):
(pool-recall key, its served-nDCG@10 keys, the first a start file holds is shown, label)."""


def first_held(keys: Sequence[str], records: Sequence[Mapping[str, Any]]) -> str | None:
    """The first of ``keys`` that every record holds, else None."""
    return next((k for k in keys if all(k in r for r in records)), None)


MECHANISM = {
    "overlap": "overlap between the rewrites' lists",
    "duplicate_rate": "duplicate rate",
    "unique_gain_share": "share of the gain only one rewrite found",
}
"""The pooled game's mechanism numbers (`policy.evaluate`'s held-out metrics) and their
labels: the cells' and starts' ``eval_metrics``."""


def _fmt(ms: tuple[float, float], digits: int = 4) -> str:
    sd = "—" if math.isnan(ms[1]) else f"{ms[1]:.{digits}f}"
    return f"{ms[0]:.{digits}f} ± {sd}"


def machine(pins: Mapping[str, Any]) -> str:
    """ "AMD EPYC, AVX-512": the CPU a result was made on and its widest float vector ISA (the
    same recipe can give other last bits of the weights on another ISA)."""
    flags = set(pins.get("isa_flags") or ())
    isa = "AVX-512" if any(f.startswith("avx512") for f in flags) else (
        "AVX2" if "avx2" in flags else "no AVX2")  # fmt: skip
    return f"{pins.get('cpu_model') or 'an unrecorded CPU'}, {isa}"


def _p(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _labels(metric: str) -> tuple[str, str]:
    """(table, plot) label of the compared metric."""
    return METRIC_LABELS.get(metric, (metric, f"held-out {metric}"))


def markdown(protocol: Protocol, envs: Mapping[str, EnvCells], result: Mapping[str, Any]) -> str:
    metric = protocol.metric
    shown = _labels(metric)[0]
    lines = [f"# Credit experiment: protocol `{protocol.name}` ({protocol.hash})", ""]
    for name, ec in envs.items():
        s = result["environments"][name]
        env = ec.env
        status = "complete" if s["cells"] >= s["planned"] else "PARTIAL"
        lines += [
            f"## {name}: {env.retriever}, merge {env.merge}"
            + (f" (k = {env.rrf_k:g})" if env.merge == "rrf" else "")
            + f", anchor {'on' if env.anchor else 'off'}, m = {env.n_actions}",
            "",
            f"{status}: {s['cells']} of {s['planned']} planned cells "
            f"({len(env.modes)} modes × {env.seeds} seeds); {s['claims']} held-out claims.",
            "",
        ]
        for v, st in s["starts"].items():
            used = (
                f"the start of seed{'s' if len(st['seeds']) > 1 else ''} "
                + ", ".join(map(str, st["seeds"]))
                if st["seeds"]
                else "no cell from it yet"
            )
            lines.append(
                f"Start {v} ({used}; made on {st['cpu']}): query alone "
                f"nDCG@10 {st['query_ndcg@10']:.4f}, query + rewrites {st['ndcg@10']:.4f}, "
                f"recall@100 {st['recall@100']:.4f}."
            )
        if not s["modes"]:
            lines += ["", "No cell yet.", ""]
            continue
        lines += _baselines(s["starts"])
        extra = next(iter(s["modes"].values()))["secondary"]
        lines += [
            "",
            f"| credit | seeds | {shown} | "
            + "".join(f"{SECONDARY_LABELS[k]} | " for k in extra)
            + "gain over start | mean \\|token advantage\\| | wall min / cell |",
            "|---|---|---|" + "---|" * len(extra) + "---|---|---|",
        ]
        for mode, m in s["modes"].items():
            gain = _fmt(m["gain_over_start"]) if m["gain_over_start"] else "—"
            adv = _fmt(m["adv_abs_mean"], 3) if m["adv_abs_mean"] else "—"
            cols = "".join(f"{_fmt(m[k])} | " for k in extra if k in m)
            lines.append(
                f"| {mode} | {len(m['seeds'])} | {_fmt(m[metric])} | {cols}"
                f"{gain} | {adv} | {_fmt(m['wall_min'], 1)} |"
            )
        lines += _budget_verdict(s, metric)
        lines += _mechanism_table(s)
        lines += ["", f"Per seed, {shown}:", ""]
        lines += _per_seed_table(s["modes"], "per_seed", ".4f")
        if any(m["per_seed_as_query"] for m in s["modes"].values()):
            at_start = ", ".join(
                f"{v} {st['as_query']:.0%}" for v, st in s["starts"].items() if st["as_query"] is not None
            )  # fmt: skip
            lines += ["Per seed, the share of claims on which query + rewrites scores exactly the "
                      f"query alone (nDCG@10; the start: {at_start or '—'}):", ""]  # fmt: skip
            lines += _per_seed_table(s["modes"], "per_seed_as_query", ".0%")
        hyps = [r for r in result["hypotheses"] if r["environment"] == name]
        if hyps:
            lines += [
                f"Pre-registered comparisons (two-level paired bootstrap over seeds, then claims; "
                f"{protocol.analysis['resamples']} resamples; {1 - protocol.analysis['alpha']:.0%} CI; "
                f"Holm within each family; equivalence margin ±{protocol.analysis['margin']}):",
                "",
                "| hypothesis | family | seeds | A − B | CI | p | Holm p | sign-flip p | per-seed A − B | claims-only CI | held? | missing seeds |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in hyps:
                label = f"{r['a']} {r['symbol']} {r['b']}"
                if r["metric"] != protocol.metric:  # a hypothesis on its own metric names it
                    label += f" ({METRIC_LABELS.get(r['metric'], (r['metric'],))[0]})"
                miss = ", ".join(map(str, r["missing_seeds"])) or "none"
                if "p" not in r:
                    lines.append(
                        f"| {label} | {r['family']} | 0 | — | — | — | — | — | — | — | not yet | {miss} |"
                    )
                    continue
                per_seed = ", ".join(f"{d:+.4f}" for d in r["per_seed_diff"])
                held = "yes" if r.get("held") else "no"
                if r["missing_seeds"]:  # a verdict waits for every pre-registered seed
                    held = f"not yet ({held} on {len(r['seeds'])} of {env.seeds} seeds)"
                elif not r.get("family_complete", True):  # and for its Holm family's members
                    held = f"not yet ({held}; family {r['family']} incomplete)"
                lines.append(
                    f"| {label} | {r['family']} | {len(r['seeds'])} | {r['mean_diff']:+.4f} | "
                    f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] | {_p(r['p'])} | {_p(r.get('p_holm'))} | "
                    f"{_p(r['sign_flip_p'])} | {per_seed} | [{r['claims_only_ci'][0]:+.4f}, "
                    f"{r['claims_only_ci'][1]:+.4f}] | {held} | {miss} |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"


def _baselines(starts: Mapping[str, Any]) -> list[str]:
    """The pooled game's baselines (:data:`BASELINES`) of each start, as a table (none in the
    list game: its start files hold no pool recall)."""
    if not any("budget_recall" in st for st in starts.values()):
        return []
    lines = ["", "Baselines on the same queries (graded recall of the pool; served nDCG@10):", "",
             "| start | candidates | pool recall | served nDCG@10 |", "|---|---|---|---|"]  # fmt: skip
    for v, st in starts.items():
        for key, ndcgs, label in BASELINES:
            if key in st:
                ndcg = first_held(ndcgs, [st])
                served = f"{st[ndcg]:.4f}" if ndcg else "—"
                lines.append(f"| {v} | {label} | {st[key]:.4f} | {served} |")
    return lines


def _budget_verdict(summary: Mapping[str, Any], metric: str) -> list[str]:
    """In the pooled game: each mode's mean pool recall against the equal-budget baseline, one
    line; a mode at or below it wastes its budget, and the line says so."""
    budgets = [st["budget_recall"] for st in summary["starts"].values() if "budget_recall" in st]
    if metric != "pool_recall" or not budgets:
        return []
    budget = statistics.fmean(budgets)
    parts = []
    for mode, m in summary["modes"].items():
        d = m[metric][0] - budget
        parts.append(f"{mode} {d:+.4f}" + (" (wastes its budget)" if d <= 0 else ""))
    return ["", f"Against the equal budget ({budget:.4f}): " + "; ".join(parts) + "."]


def _mechanism_table(summary: Mapping[str, Any]) -> list[str]:
    """In the pooled game: how each mode's rewrites spend their budget, held-out (the cells'
    ``eval_metrics``), beside its start's: the overlap between the rewrites' lists, the share
    of actions that repeat an earlier one word for word, and the share of the pool's gain over
    the query's own list that documents only one rewrite found. Nothing for cells without
    them (the SciFact game)."""
    modes = summary["modes"]
    if not modes or any(set(m["mechanism"]) != set(MECHANISM) for m in modes.values()):
        return []
    lines = ["", "How the rewrites spend the budget (held-out; mean ± sd over seeds):", "",
             "| credit | " + " | ".join(MECHANISM.values()) + " |",
             "|---|" + "---|" * len(MECHANISM)]  # fmt: skip
    for v, st in summary["starts"].items():
        if set(st["mechanism"]) == set(MECHANISM):
            lines.append(f"| the start {v} | "
                         + " | ".join(f"{st['mechanism'][k]:.4f}" for k in MECHANISM) + " |")  # fmt: skip
    for mode, m in modes.items():
        lines.append(f"| {mode} | " + " | ".join(_fmt(m["mechanism"][k]) for k in MECHANISM) + " |")
    return lines


def _per_seed_table(modes: Mapping[str, Any], key: str, fmt: str) -> list[str]:
    """A markdown table, one row per mode and one column per seed, of ``modes[mode][key]``
    (a {seed: value} map; "—" where a seed has no value), then a blank line."""
    seeds = sorted({seed for m in modes.values() for seed in m["seeds"]})
    lines = ["| credit | " + " | ".join(f"seed {k}" for k in seeds) + " |",
             "|---|" + "---|" * len(seeds)]  # fmt: skip
    for mode, m in modes.items():
        vals = [format(m[key][k], fmt) if k in m[key] else "—" for k in seeds]
        lines.append(f"| {mode} | " + " | ".join(vals) + " |")
    return [*lines, ""]


def plot(envs: Mapping[str, EnvCells], metric: str) -> bytes:
    """The PNG: per environment, the training reward per mode and each cell's end value."""
    plt = pyplot()
    shown = [ec for ec in envs.values() if ec.cells]
    fig, axes = plt.subplots(
        max(1, len(shown)), 2, figsize=(11, 4 * max(1, len(shown))), squeeze=False
    )
    for row, ec in zip(axes, shown, strict=False):
        left, right = row
        for i, mode in enumerate(ec.env.modes):
            cells = [ec.cells[k] for k in sorted(ec.cells) if k[0] == mode]
            if not cells:
                continue
            n = min(len(c["steps"]) for c in cells)
            if n:
                curve = np.mean([[s["reward_mean"] for s in c["steps"][:n]] for c in cells], axis=0)
                left.plot(range(1, n + 1), curve, label=f"{mode} (n={len(cells)})")
            ys = [statistics.fmean(c[metric]) for c in cells]
            right.scatter([i] * len(ys), ys, alpha=0.6)
            right.errorbar([i + 0.2], [statistics.fmean(ys)], fmt="o", color="black")
        for v, st in sorted(ec.starts.items()):
            right.axhline(statistics.fmean(st[metric]), color="gray", linestyle="--",
                          label=f"start {v[:8]}")  # fmt: skip
        if metric == "pool_recall":  # the pooled game's baselines (one line each: starts agree)
            first = ec.starts[min(ec.starts)] if ec.starts else {}
            for key, style, label in (("budget_recall", ":", "equal budget"),
                                      ("prf_recall", "-.", "keyword expansion")):  # fmt: skip
                if key in first:
                    right.axhline(statistics.fmean(first[key]), color="firebrick",
                                  linestyle=style, label=label)  # fmt: skip
        left.set(xlabel="training step", ylabel="training reward v(N), mean over seeds",
                 title=f"{ec.env.name}: training reward")  # fmt: skip
        right.set_xticks(range(len(ec.env.modes)), list(ec.env.modes))
        right.set(ylabel=_labels(metric)[1], title=f"{ec.env.name}: end of each cell")
        for ax in row:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90, metadata=PNG_METADATA)
    plt.close(fig)
    return png.getvalue()
