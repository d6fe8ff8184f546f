"""The audit report as JSON: :func:`build_report` turns an :class:`evaluator.audit.AuditResult`
(tensors) into plain data once, :func:`validate_report` checks it against
``audit_schema.json``, and :func:`summary` says the verdict in plain words.

The HTML report (:mod:`app.reports.audit_html`) is rendered from this JSON alone, so a stored
report can be re-rendered any time. Non-finite numbers (a size without pairs) become null.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

from torch import Tensor

from evaluator.audit import AuditResult
from evaluator.audit_stats import RatioCI

SCHEMA_PATH = Path(__file__).with_name("audit_schema.json")
SCHEMA_VERSION = 1

MODE_WORDS = {
    "shapley": "use Shapley credit from it",
    "singleton": "prefer singleton credit v({j}) − v(∅) (its size-1 marginals agree)",
    "leave_one_out": "prefer leave-one-out credit v(N) − v(N∖{j}) (its full-set marginals agree)",
    "none": "do not train on its credit: fall back to the reference, or refit it",
}


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _ratio(ci: RatioCI, i: int = 0) -> dict[str, float | None]:
    return {
        "estimate": _num(float(ci.estimate[i])),
        "ci_low": _num(float(ci.low[i])),
        "ci_high": _num(float(ci.high[i])),
        "n": float(ci.denominator[i]),
    }


def _sizes(result: AuditResult) -> list[dict[str, Any]]:
    s = result.sizes
    rows = []
    for i in range(s.n_pairs.shape[0]):
        agree, decisive = _ratio(s.agree, i), _ratio(s.decisive, i)
        rows.append({
            "k": i + 1, "n_pairs": int(s.n_pairs[i]),
            "agree": agree["estimate"], "ci_low": agree["ci_low"], "ci_high": agree["ci_high"],
            "decisive_agree": decisive["estimate"], "decisive_pairs": int(decisive["n"] or 0),
            "ties_both": float(s.ties_both[i]), "ties_train_only": float(s.ties_train_only[i]),
            "ties_reference_only": float(s.ties_reference_only[i]),
            "passed": bool(s.passed[i]), "has_pairs": bool(s.has_pairs[i]),
        })  # fmt: skip
    return rows


def _cheap(table: dict[int, dict[str, Tensor]]) -> list[dict[str, Any]]:
    return [
        {"m": m, **{k: (int(v) if k == "n_rollouts" else float(v)) for k, v in row.items()}}
        for m, row in sorted(table.items())
    ]


def build_report(
    result: AuditResult, *, train: dict[str, str], reference: dict[str, str], meta: dict[str, Any]
) -> dict[str, Any]:
    """The report JSON (see ``audit_schema.json``); ``meta`` = where the rollouts came from,
    versions, timings (copied as is)."""
    cfg = result.config
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "train_evaluator": dict(train),
        "reference_evaluator": dict(reference),
        "n_rollouts": result.n_rollouts,
        "n_queries": result.n_queries,
        "config": {
            "tol": cfg.tol,
            "threshold": cfg.threshold,
            "n_boot": cfg.n_boot,
            "level": cfg.level,
            "seed": cfg.seed,
        },  # fmt: skip
        "sizes": _sizes(result),
        "phi": {
            "sign_agree": _ratio(result.phi_agree),
            "kendall_tau": _ratio(result.kendall),
            "top_agree": _ratio(result.top_agree),
        },
        "cheap_credit": {name: _cheap(table) for name, table in result.cheap_credit.items()},
        "tolerance_sweep": [
            {"tol": tol, "agree": [_num(float(x)) for x in agree.tolist()]}
            for tol, agree in sorted(result.sweep.items())
        ],
        "verdict": result.verdict,
        "recommended_credit": result.recommended,
        **(
            {"leave_one_out_agree": _ratio(result.leave_one_out)}
            if result.leave_one_out is not None
            else {}
        ),
        "scatter": {k: [round(float(x), 6) for x in v.tolist()] for k, v in result.scatter.items()},
        "meta": meta,
    }
    report["summary"] = summary(report)
    return report


def _size_list(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"size {r['k']}: {r['agree']:.2f}" for r in rows)


def summary(report: dict[str, Any]) -> str:
    """The verdict in plain words (rendered at the top of the HTML report)."""
    train, ref = report["train_evaluator"]["name"], report["reference_evaluator"]["name"]
    thr = report["config"]["threshold"]
    judged = [r for r in report["sizes"] if r["has_pairs"]]
    failed = [r for r in judged if not r["passed"]]
    mode = report["recommended_credit"]
    if not judged:
        return f"No marginal contributions to compare: the rollouts had no actions. No verdict for {train}."
    if not failed:
        low = min(judged, key=lambda r: r["agree"])
        head = (
            f"The {train} evaluator agrees with {ref} on the sign of marginal contributions at "
            f"every coalition size (lowest: {low['agree']:.2f} at size {low['k']}, threshold {thr:.2f})."
        )
    else:
        passed = [r for r in judged if r["passed"]]
        head = (
            f"The {train} evaluator disagrees with {ref} too often at "
            f"{_size_list(failed)} (below the threshold {thr:.2f})"
            + (f"; it agrees at {_size_list(passed)}." if passed else ".")
        )
    phi = report["phi"]["sign_agree"]["estimate"]
    tail = f" Sign agreement of Shapley φ: {phi:.2f}." if phi is not None else ""
    return f"{head}{tail} Recommendation: {MODE_WORDS[mode]}."


@cache
def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    return loaded


def validate_report(report: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` when ``report`` does not match the schema."""
    import jsonschema  # lazy: only validation needs it (~0.2 s to import)

    jsonschema.validate(report, schema(), cls=jsonschema.Draft202012Validator)
