"""`casi audit credits`' report: the where-credits-differ measurement
(:func:`app.training.credit_report.credit_report`) as table cells, Markdown and JSON. Plain data
in, text out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def _pct(x: float) -> str:
    return "–" if x != x else f"{100 * x:.1f} %"


def _f(x: float, digits: int = 3) -> str:
    return "–" if x != x else f"{x:+.{digits}f}"


COLUMNS = (
    "retriever", "merge", "m", "anchor", "rollouts", "v changes", "singleton ≠ Shapley",
    "leave-one-out ≠ Shapley", "|φ − singleton| / |gain|", "|φ − LOO| / |gain|",
    "mean interaction", "mean |interaction|", "v(∅)", "mean gain",
)  # fmt: skip


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    """The report's rows as table cells (what the CLI prints and the Markdown holds)."""
    out = []
    for r in report["rows"]:
        merge = r["merge"] + (f" (k={report['request']['rrf_k']:g})" if r["merge"] == "rrf" else "")
        m = str(r["m"]) if r["actions_mean"] == r["m"] else f"≤ {r['m']}"  # free format: up to m
        n = str(r["n_rollouts"]) + (
            f" ({r['n_ranked']} ranked)" if r["n_ranked"] != r["n_rollouts"] else ""
        )
        out.append([
            r["retriever"], merge, m, "on" if r["anchor"] else "off", n,
            _pct(r["v_changes"]), _pct(r["singleton_rank_differs_of_ranked"]),
            _pct(r["leave_one_out_rank_differs_of_ranked"]), _f(r["singleton_gap"]).lstrip("+"),
            _f(r["leave_one_out_gap"]).lstrip("+"), _f(r["interaction_mean"], 4),
            _f(r["interaction_abs_mean"], 4).lstrip("+"), _f(r["v_empty_mean"], 4).lstrip("+"),
            _f(r["gain_mean"], 4),
        ])  # fmt: skip
    return out


def to_markdown(report: dict[str, Any]) -> str:
    """The table and what it measured, as Markdown."""
    sources = "; ".join(
        f"m = {m}: {ro['n_rollouts']} rollouts of {ro['n_queries']} {ro.get('split') or ''} claims "
        f"({ro.get('source', '?')}, policy {ro.get('policy_version') or '?'}"
        + (f", {ro['rollouts_file']}" if ro.get("rollouts_file") else "") + ")"
        for m, ro in report["rollouts"].items()
    )  # fmt: skip
    machine = report["machine"]
    lines = [
        "# Where do the credits differ?",
        "",
        f"Rollouts: {sources}. Replay nDCG@{report['list_k']} against the qrels; "
        f"{report['n_documents']} documents; indexes {', '.join(f'{k} {v}' for k, v in report['indexes'].items())}. "
        f"Machine: {machine['cpu_model']} ({', '.join(machine['isa_flags'])}), {machine['cpu_count']} cores.",
        "",
        "Per game (retriever × merge rule × m × the query as an anchor or not): the share of "
        "rollouts where the rewrites change v at all; the share of rollouts (with ≥ 2 actions) "
        "whose actions singleton / leave-one-out credit order differently from Shapley (a tie on "
        "one side and a strict order on the other counts); their mean per-action distance from "
        "Shapley relative to |v(N) − v(∅)| (rollouts with a gain); the mean pairwise Shapley "
        "interaction (negative: redundant rewrites, positive: complementary); v(∅) (anchor on: "
        "nDCG of the query alone; off: 0) and the mean gain v(N) − v(∅) (anchor on: query + "
        "rewrites over the query alone; off: over the empty list). m ≤ 4: free-format rollouts "
        "with up to m actions (ranked: those with ≥ 2).",
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
