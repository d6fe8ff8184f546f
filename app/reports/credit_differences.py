"""`casi audit credits`' report: the where-credits-differ measurement
(:func:`app.services.credit_report.credit_report`) as table cells, Markdown and JSON. Plain data
in, text out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from evaluator.credit_diff import RANK_KEYS


def _pct(x: float) -> str:
    return "–" if x != x else f"{100 * x:.1f} %"


def _f(x: float, digits: int = 3) -> str:
    return "–" if x != x else f"{x:+.{digits}f}"


COLUMNS = (
    "retriever", "merge", "m", "anchor", "rollouts", "v changes (any S)", "v(N) ≠ v(∅)",
    "singleton ≠ Shapley (tie-aware)", "singleton reverses Shapley (strict)",
    "LOO ≠ Shapley (tie-aware)", "LOO reverses Shapley (strict)", "|φ − singleton| / |gain|",
    "|φ − LOO| / |gain|", "mean interaction", "mean |interaction|", "v(∅)", "mean gain",
)  # fmt: skip
RANK_COLUMNS = tuple(f"{key}_of_ranked" for key in RANK_KEYS)  # the four ordering columns' keys
DEFINITIONS = (
    "**v changes (any S)** (`v_any_changes`): the share of rollouts in which some coalition's "
    "value v(S) differs from v(∅).",
    "**v(N) ≠ v(∅)** (`v_full_changes`): the share of rollouts in which all the rewrites "
    "together change the value, |v(N) − v(∅)| > tol; it is at most the any-S share.",
    "**≠ Shapley (tie-aware)** (`*_rank_differs_tie_aware`): the share of ranked rollouts with a "
    "pair of actions whose order signs differ, so a tie on one side against a strict order on "
    "the other counts (the audit's `rank_differs`).",
    "**reverses Shapley (strict)** (`*_rank_reversed_strict`): the share of ranked rollouts with "
    "a pair the credit orders strictly opposite to Shapley, sign(c_j − c_k) = −sign(φ_j − φ_k) "
    "≠ 0; ties never count.",
)
"""One sentence per measurement that has two readings (which column is which)."""


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    """The report's rows as table cells (what the CLI prints and the Markdown holds)."""
    out = []
    for r in report["rows"]:
        merge = r["merge"] + (f" (k={report['request']['rrf_k']:g})" if r["merge"] == "rrf" else "")
        merge += " (graded recall)" if r["merge"] == "pool" else ""
        m = str(r["m"]) if r["actions_mean"] == r["m"] else f"≤ {r['m']}"  # free format: up to m
        n = str(r["n_rollouts"]) + (
            f" ({r['n_ranked']} ranked)" if r["n_ranked"] != r["n_rollouts"] else ""
        )
        out.append([
            r["retriever"], merge, m, "on" if r["anchor"] else "off", n,
            _pct(r["v_any_changes"]), _pct(r["v_full_changes"]),
            *(_pct(r[key]) for key in RANK_COLUMNS), _f(r["singleton_gap"]).lstrip("+"),
            _f(r["leave_one_out_gap"]).lstrip("+"), _f(r["interaction_mean"], 4),
            _f(r["interaction_abs_mean"], 4).lstrip("+"), _f(r["v_empty_mean"], 4).lstrip("+"),
            _f(r["gain_mean"], 4),
        ])  # fmt: skip
    return out


def rollout_sources(report: dict[str, Any]) -> list[str]:
    """One line per m: how many rollouts of which claims, sampled by which policy (name and
    version), in which format and how many well-formed, from which file."""
    lines = []
    for m, ro in report["rollouts"].items():
        fmt = f"{ro.get('format') or '?'} format"
        if not ro.get("format_recorded", True):
            fmt += " (not recorded; inferred: sampled before the constrained format existed)"
        ok = ro.get("format_ok")
        lines.append(
            f"m = {m}: {ro['n_rollouts']} rollouts of {ro['n_queries']} {ro.get('split') or ''} "
            f"claims, {ro.get('source', '?')} from policy {ro.get('policy_name') or '?'} "
            f"(version {ro.get('policy_version') or '?'}), {fmt}, format_ok "
            f"{'?' if ok is None else _pct(ok)}"
            + (f"; stored in {ro['rollouts_file']}" if ro.get("rollouts_file") else "")
        )  # fmt: skip
    return lines


def to_markdown(report: dict[str, Any]) -> str:
    """The table, where its rollouts came from and what it measured, as Markdown."""
    machine = report["machine"]
    indexes = ", ".join(f"{k} {v}" for k, v in report["indexes"].items())
    lines = [
        "# Where do the credits differ?",
        "",
        "Rollouts:",
        "",
        *(f"- {line}." for line in rollout_sources(report)),
        "",
        f"Replay nDCG@{report['list_k']} against the qrels"
        + (
            ""
            if all(r["merge"] != "pool" for r in report["rows"])
            else " (merge rule pool: the pooled game, graded recall of the union of the lists)"
        )
        + f"; {report['n_documents']} documents; "
        f"indexes {indexes}. Machine: {machine['cpu_model']} "
        f"({', '.join(machine['isa_flags'])}), {machine['cpu_count']} cores; "
        f"{report['elapsed_s']} s ({report['rollouts_s']} s sampling).",
        "",
        "Per game (retriever × merge rule × m × the query as an anchor or not): how often the "
        "rewrites change v; how often singleton / leave-one-out credit order a ranked rollout's "
        "(≥ 2 actions) actions differently from Shapley; their mean per-action distance from "
        "Shapley relative to |v(N) − v(∅)| (rollouts with a gain); the mean pairwise Shapley "
        "interaction (negative: redundant rewrites, positive: complementary); v(∅) (anchor on: "
        "nDCG of the query alone; off: 0) and the mean gain v(N) − v(∅) (anchor on: query + "
        "rewrites over the query alone; off: over the empty list). “≤ m” in the m column: "
        "free-format rollouts with up to m actions (ranked: those with ≥ 2). Two questions have two "
        "readings, side by side:",
        "",
        *(f"- {d}" for d in DEFINITIONS),
        "",
        "| " + " | ".join(c.replace("|", "\\|") for c in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(report)]
    if report["skipped_m"]:
        lines += ["", f"Not measured: m = {report['skipped_m']} (the stored rollouts have m = "
                  f"{', '.join(report['rollouts'])})."]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path, name: str) -> tuple[Path, Path]:
    """``<out_dir>/<name>.json`` and ``.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{name}.json", out_dir / f"{name}.md"
    js.write_text(json.dumps(report, indent=1, default=_jsonable))
    md.write_text(to_markdown(report))
    return md, js


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")
