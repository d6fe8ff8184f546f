"""`casi experiment aggregate <folder>`: every committed cell of a protocol turned into the answer.

Read :func:`aggregate`. It reads FILES only — ``<folder>/protocol.toml`` and the result files
``<folder>/<environment>/<mode>-seed<K>.json`` and ``start-<hash>.json`` that
`app.experiments.cell` writes — never a database or var/. Before anything is computed or written
it checks every file (`app.experiments.results_folder.load_folder`): its values (`app.experiments.result_file`), its name
(exactly ``<mode>-seed<K>.json`` or ``start-<version>.json``, matching what it holds; another
file in an environment's folder is refused, as are two files claiming one cell), its protocol
hash, its claims (those of the other files), its seed (one the protocol plans), its start (one
per seed, and its evaluation present). Then, per environment:

- per mode: mean ± sd over seeds of the compared metric (the protocol's ``[analysis] metric``,
  default held-out nDCG@10 of query + rewrites) and recall@100, the gain over the start, the
  mean |token advantage| of training, the wall time;
- per seed: the compared metric of every mode;
- every pre-registered hypothesis of the protocol, on the seeds whose cells are complete for
  both of its modes (the others are named as missing; a ``b`` naming a baseline,
  `app.experiments.protocol.BASELINE_METRICS`, needs only A's cell of the seed, which holds the
  baseline's per-claim values): the per-(seed, claim) difference A − B
  through the two-level paired bootstrap (:func:`evaluator.stats.two_level_bootstrap`: seeds,
  then claims within them), its CI and p, the per-seed differences, the exact sign-flip p over
  seeds (with the same sides as the p), the claims-only bootstrap for reference, and the
  Holm-adjusted p within the hypothesis' family (every pre-registered member counts, one not
  tested yet with p = 1; held when p̃ ≤ α, final only once every member of the family has all
  its seeds); the p of each kind is :data:`HYPOTHESIS_TESTS`'s. ``greater``: p = P*(mean A − B
  ≤ 0). ``equivalent``: two one-sided tests against the protocol's margin δ, p = max(P*(d ≤
  −δ), P*(d ≥ δ)). ``two_sided``: twice the smaller tail.

Only then does it write ``table.md`` and ``ndcg.png`` into the folder (rendered by
`app.experiments.render`), each atomically; the same files give the same bytes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.experiments.protocol import Hypothesis, load_protocol
from app.experiments.render import (
    BASELINES,
    MECHANISM,
    SECONDARY,
    first_held,
    machine,
    markdown,
    plot,
)
from app.experiments.results_folder import EnvCells, load_folder
from evaluator.artifacts import atomic_file, atomic_write_text
from evaluator.stats import (
    TwoLevelBootstrap,
    holm,
    paired_bootstrap,
    sign_flip_equivalence,
    sign_flip_test,
    two_level_bootstrap,
)

AS_QUERY = ("ndcg@10", "query_ndcg@10")
"""The lists whose per-claim equality means the rewrites changed nothing the metric sees."""


@dataclass(frozen=True)
class HypothesisTest:
    """How one kind of hypothesis is tested: its p from the two-level bootstrap of A − B."""

    symbol: str  # between A and B in the table: "shapley > broadcast"
    p: Callable[[TwoLevelBootstrap, np.ndarray, np.ndarray, dict[str, Any], float], float]
    sign_flip: Callable[[np.ndarray, float], float]  # the exact test over seeds, same sides


def _p_greater(test: TwoLevelBootstrap, a: Any, b: Any, kw: dict[str, Any], margin: float) -> float:
    return test.p_one_sided


def _p_equivalent(
    test: TwoLevelBootstrap, a: Any, b: Any, kw: dict[str, Any], margin: float
) -> float:
    """Two one-sided tests against the margin (the same resamples: same seed, same shape)."""
    low = two_level_bootstrap(a + margin, b, **kw).p_one_sided  # P*(d ≤ −δ)
    high = two_level_bootstrap(b + margin, a, **kw).p_one_sided  # P*(d ≥ δ)
    return max(low, high)


def _p_two_sided(
    test: TwoLevelBootstrap, a: Any, b: Any, kw: dict[str, Any], margin: float
) -> float:
    """Twice the smaller tail: 2·min(P*(d ≤ 0), P*(d ≥ 0)) (ties counted half), at most 1."""
    return min(1.0, 2 * min(test.p_one_sided, 1 - test.p_one_sided))


HYPOTHESIS_TESTS: dict[str, HypothesisTest] = {
    "greater": HypothesisTest(">", _p_greater, lambda x, margin: sign_flip_test(x)),
    "equivalent": HypothesisTest("≈", _p_equivalent, sign_flip_equivalence),
    "two_sided": HypothesisTest(
        "≠", _p_two_sided, lambda x, margin: sign_flip_test(x, "two_sided")
    ),
}
"""One test per kind of `app.experiments.protocol_keys.HYPOTHESIS_KINDS`."""


def _mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample sd; one value has no sd (NaN, printed "—")."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else math.nan)


def _as_query(result: Mapping[str, Any]) -> float | None:
    """The share of claims on which query + rewrites scores exactly what the query alone scores
    (nDCG@10): the rewrites changed nothing the metric sees (a rewrite that retrieves nothing, or
    repeats the query, leaves an anchored rrf list as the query's)."""
    combined, query = (result.get(key) for key in AS_QUERY)
    if not combined or not query or len(combined) != len(query):
        return None
    same = sum(abs(float(a) - float(b)) <= 1e-12 for a, b in zip(combined, query, strict=True))
    return same / len(combined)


def _adv_abs(cell: Mapping[str, Any]) -> float | None:
    vals = [s["adv_abs_mean"] for s in cell.get("steps", []) if "adv_abs_mean" in s]
    return statistics.fmean(vals) if vals else None


def _compare(
    h: Hypothesis, ec: EnvCells, analysis: Mapping[str, Any], metric: str, baseline: str | None
) -> dict[str, Any]:
    """One hypothesis tested on the seeds that have its cells; ``baseline``: the per-claim key
    of A's cells holding B's values (B a baseline), else None (B's own cells)."""
    seeds = sorted(
        s for (m, s) in ec.cells if m == h.a and (baseline is not None or (h.b, s) in ec.cells)
    )
    missing = sorted(set(range(ec.env.seeds)) - set(seeds))  # every cell's seed is planned
    row: dict[str, Any] = {"name": h.name, "environment": h.environment, "a": h.a, "b": h.b,
                           "kind": h.kind, "symbol": HYPOTHESIS_TESTS[h.kind].symbol,
                           "family": h.family, "seeds": seeds, "missing_seeds": missing,
                           "metric": metric}  # fmt: skip
    if not seeds:
        return row
    a = np.array([ec.cells[(h.a, s)][metric] for s in seeds])
    b = np.array(
        [ec.cells[(h.a, s)][baseline] if baseline else ec.cells[(h.b, s)][metric] for s in seeds]
    )
    kw: dict[str, Any] = {
        "n_resamples": int(analysis["resamples"]),
        "seed": int(analysis["seed"]),
        "level": 1 - float(analysis["alpha"]),
    }
    test = two_level_bootstrap(a, b, **kw)
    claims_only = paired_bootstrap(a.mean(axis=0), b.mean(axis=0), **kw)
    row.update(
        mean_diff=test.mean_diff, ci_low=test.ci_low, ci_high=test.ci_high,
        per_seed_diff=list(test.per_seed_diff), claims_only_ci=[claims_only.ci_low, claims_only.ci_high],
        sign_flip_p=(
            None if test.sign_flip_p is None  # more seeds than the exact test enumerates
            else HYPOTHESIS_TESTS[h.kind].sign_flip(np.asarray(test.per_seed_diff), float(analysis["margin"]))
        ),
    )  # fmt: skip
    row["p"] = HYPOTHESIS_TESTS[h.kind].p(test, a, b, kw, float(analysis["margin"]))
    return row


def aggregate(folder: Path) -> dict[str, Any]:
    """Read and check every result under ``folder``, then write ``table.md`` and ``ndcg.png``
    (each atomically, only once every check passed); return the data."""
    folder = Path(folder)
    protocol = load_protocol(folder / "protocol.toml")
    metric = protocol.metric
    envs = load_folder(folder, protocol)
    rows = [
        _compare(
            h,
            envs[h.environment],
            protocol.analysis,
            protocol.metric_of(h),
            protocol.baseline_key(h),
        )  # fmt: skip
        for h in protocol.hypotheses
    ]
    for family in sorted({r["family"] for r in rows}):
        members = [r for r in rows if r["family"] == family]
        # every pre-registered member counts in m; one not tested yet enters with p = 1 (a
        # member left out would shrink m and the adjusted p of the others)
        adjusted = holm({r["name"]: r.get("p", 1.0) for r in members})
        complete = all(r["seeds"] and not r["missing_seeds"] for r in members)
        for r in members:
            r["family_complete"] = complete  # a verdict is final only when its family is
            if "p" in r:
                r["p_holm"] = adjusted[r["name"]]
                r["held"] = r["p_holm"] <= float(protocol.analysis["alpha"])  # reject p̃ ≤ α
    result = {"protocol": {"name": protocol.name, "hash": protocol.hash}, "metric": metric,
              "environments": {n: _env_summary(ec, metric) for n, ec in envs.items()}, "hypotheses": rows}  # fmt: skip
    table = markdown(protocol, envs, result)
    png = plot(envs, metric)
    atomic_write_text(folder / "table.md", table)
    with atomic_file(folder / "ndcg.png") as tmp:
        tmp.write_bytes(png)
    return result


def _env_summary(ec: EnvCells, metric: str) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode in ec.env.modes:
        cells = [ec.cells[(m, s)] for (m, s) in sorted(ec.cells) if m == mode]
        if not cells:
            continue
        # every cell's start is here (`_check_starts`): the gain averages every seed
        gains = [
            statistics.fmean(c[metric]) - statistics.fmean(ec.starts[c["start"]["version"]][metric])
            for c in cells
        ]
        adv = [x for x in (_adv_abs(c) for c in cells) if x is not None]
        held = (first_held([k for k in keys if k != metric], cells) for _, keys in SECONDARY)
        shown = [k for k in held if k is not None]
        modes[mode] = {
            "seeds": [int(c["seed"]) for c in cells],
            metric: _mean_sd([statistics.fmean(c[metric]) for c in cells]),
            **{k: _mean_sd([statistics.fmean(c[k]) for c in cells]) for k in shown},
            "secondary": shown,
            "gain_over_start": _mean_sd(gains),
            "adv_abs_mean": _mean_sd(adv) if adv else None,
            "wall_min": _mean_sd([c["compute"]["wall_s"] / 60 for c in cells]),
            "mechanism": {
                k: _mean_sd([c["eval_metrics"][k] for c in cells])
                for k in MECHANISM
                if all(k in c.get("eval_metrics", {}) for c in cells)
            },
            "per_seed": {int(c["seed"]): statistics.fmean(c[metric]) for c in cells},
            "per_seed_as_query": {
                int(c["seed"]): share for c in cells if (share := _as_query(c)) is not None
            },
        }
    starts = {
        v: {**{k: statistics.fmean(s[k]) for key, ndcgs, _ in BASELINES for k in (key, *ndcgs)
               if k in s},
            "ndcg@10": statistics.fmean(s["ndcg@10"]),
            "query_ndcg@10": statistics.fmean(s["query_ndcg@10"]),
            "recall@100": statistics.fmean(s["recall@100"]), "as_query": _as_query(s),
            "seeds": sorted({seed for (_, seed), c in ec.cells.items() if c["start"]["version"] == v}),
            "cpu": machine(s.get("pins", {})),
            "mechanism": {k: s["eval_metrics"][k] for k in MECHANISM if k in s.get("eval_metrics", {})}}
        for v, s in sorted(ec.starts.items())
    }  # fmt: skip
    return {"modes": modes, "starts": starts, "cells": len(ec.cells),
            "planned": len(ec.env.modes) * ec.env.seeds, "claims": len(ec.claims or [])}  # fmt: skip
