"""Issue 50's protocol pieces for a policy that reads its first retrieval: hypotheses against a
baseline (keyword expansion, the query alone, the equal budget) read off A's cells and tested
with the same two-level bootstrap; the served nDCG@10 per claim and the degenerate rate in a
cell's file; the teacher's [start] and the learning curve's [evaluation] keys."""

from __future__ import annotations

import json
import shutil
import statistics
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.experiments.aggregate import aggregate
from app.experiments.cell import _pool_rows
from app.experiments.protocol import BASELINE_METRICS, load_protocol, protocol_hash
from app.experiments.result_file import check_result
from app.experiments.schedule import protocol_status
from evaluator.stats import two_level_bootstrap

ROOT = Path(__file__).resolve().parents[2]
POOLED = ROOT / "docs" / "experiments" / "credit-pool"
TEXT = (POOLED / "protocol.toml").read_text(encoding="utf-8")

BASELINE_HYPOTHESES = """
[[hypotheses]]
name = "shapley > keyword_expansion"
environment = "pool"
a = "shapley"
b = "keyword_expansion"
kind = "greater"
family = "baselines"

[[hypotheses]]
name = "shapley > budget"
environment = "pool"
a = "shapley"
b = "budget"
kind = "greater"
family = "baselines"
"""


def _with(text: str, extra: str) -> str:
    """``text`` with ``extra`` (hypotheses) before [analysis] and 200 resamples."""
    at = text.index("[analysis]")
    return (text[:at] + extra.lstrip("\n") + "\n" + text[at:]).replace(
        "resamples = 10000", "resamples = 200"
    )


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "protocol.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_baseline_hypothesis_reads_the_baselines_key(tmp_path: Path) -> None:
    protocol = load_protocol(_write(tmp_path, _with(TEXT, BASELINE_HYPOTHESES)))
    keys = {h.name: protocol.baseline_key(h) for h in protocol.hypotheses}
    assert keys["shapley > keyword_expansion"] == "prf_recall"
    assert keys["shapley > budget"] == "budget_recall"
    assert keys["shapley > broadcast"] is None  # a mode: its own cells
    assert protocol.held == ("pool_recall", "overlap", "prf_recall", "budget_recall")
    assert BASELINE_METRICS["keyword_expansion"]["served_ndcg@10"] == "prf_served_ndcg@10"
    assert BASELINE_METRICS["query"]["ndcg@10"] == "query_ndcg@10"


@pytest.mark.parametrize(
    ("b", "metric", "usable"),
    [
        ("budget", "ndcg@10", "keyword_expansion, query"),  # the budget has no served list
        ("budget", "overlap", "none"),
        ("random", "pool_recall", "keyword_expansion, query, budget"),
    ],
)
def test_a_b_that_is_neither_a_mode_nor_a_usable_baseline_is_refused(
    tmp_path: Path, b: str, metric: str, usable: str
) -> None:
    extra = (f'[[hypotheses]]\nname = "x"\nenvironment = "pool"\na = "shapley"\nb = "{b}"\n'
             f'kind = "greater"\nmetric = "{metric}"\n')  # fmt: skip
    with pytest.raises(ValueError) as info:
        load_protocol(_write(tmp_path, _with(TEXT, extra)))
    assert f"[hypotheses[5]] b = '{b}': neither one of its environment's modes" in str(info.value)
    assert f"nor a baseline of {metric} ({usable})" in str(info.value)


def _pooled_copy(tmp_path: Path, text: str) -> Path:
    """The committed pooled cells under ``text`` (their hash re-labelled)."""
    dst = tmp_path / "credit-pool"
    shutil.copytree(POOLED / "pool", dst / "pool")
    (dst / "protocol.toml").write_text(text, encoding="utf-8")
    new_hash = protocol_hash(tomllib.loads(text))
    for path in dst.glob("*/*.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        data["protocol"]["hash"] = new_hash
        path.write_text(json.dumps(data), encoding="utf-8")
    return dst


def test_a_baseline_hypothesis_is_tested_on_as_cells_alone(tmp_path: Path) -> None:
    """B's per-claim values are the A cell's own baseline values (the same deterministic
    baseline in every cell), through the same two-level bootstrap; a seed needs only A's cell,
    and the status asks for nothing beyond the environment's modes."""
    dst = _pooled_copy(tmp_path, _with(TEXT, BASELINE_HYPOTHESES))
    for mode in ("broadcast", "singleton"):  # B's cells of seed 5 gone: the baselines still test
        (dst / "pool" / f"{mode}-seed5.json").unlink()
    result = aggregate(dst)
    cells = {s: json.loads((dst / "pool" / f"shapley-seed{s}.json").read_text()) for s in range(6)}
    rows = {r["name"]: r for r in result["hypotheses"]}
    for name, key in (("shapley > keyword_expansion", "prf_recall"),
                      ("shapley > budget", "budget_recall")):  # fmt: skip
        row = rows[name]
        assert row["seeds"] == list(range(6)) and row["missing_seeds"] == []
        a = np.array([cells[s]["pool_recall"] for s in range(6)])
        b = np.array([cells[s][key] for s in range(6)])
        assert (
            row["p"] == two_level_bootstrap(a, b, n_resamples=200, seed=0, level=0.95).p_one_sided
        )
        per_seed = [statistics.fmean(cells[s]["pool_recall"]) - statistics.fmean(cells[s][key])
                    for s in range(6)]  # fmt: skip
        np.testing.assert_allclose(row["per_seed_diff"], per_seed, rtol=0, atol=1e-12)
    assert rows["shapley > broadcast"]["missing_seeds"] == [5]  # a mode's B: its own cells
    table = (dst / "table.md").read_text(encoding="utf-8")
    assert "| shapley > keyword_expansion | baselines | 6 |" in table
    assert "| shapley > budget | baselines | 6 |" in table
    protocol = load_protocol(dst / "protocol.toml")
    status = {r.seed: r for r in protocol_status(dst, protocol, None, (), [])}
    assert status[5].missing == ("broadcast", "singleton")  # modes only, never a baseline
    assert all(status[s].here == "done" for s in range(5))


def test_a_cell_without_the_baselines_values_is_refused(tmp_path: Path) -> None:
    dst = _pooled_copy(tmp_path, _with(TEXT, BASELINE_HYPOTHESES))
    path = dst / "pool" / "shapley-seed2.json"
    data = json.loads(path.read_text())
    data.pop("prf_recall")
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"pool/shapley-seed2.json: field 'prf_recall'"):
        aggregate(dst)


def _row(i: int, served: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"pool": [0.1, 0.2, 0.3], "budget": 0.25, "prf": 0.2, "prf_ndcg": 0.4,
                           "overlap": 0.5, "query_id": str(i)}  # fmt: skip
    if served:
        row.update(served_ndcg=0.6 + i / 100, prf_served_ndcg=0.5 - i / 100)
    return row


def test_a_cell_records_the_served_ndcg_per_claim_where_the_evaluation_has_it() -> None:
    got = _pool_rows([_row(0, True), _row(1, True)])
    assert got["served_ndcg@10"] == [0.6, 0.61] and got["prf_served_ndcg@10"] == [0.5, 0.49]
    assert "served_ndcg@10" not in _pool_rows([_row(0, False), _row(1, False)])


def _start_file(**extra: Any) -> dict[str, Any]:
    return {"format": "casi-credit-start/1", "environment": "pool",
            "protocol": {"name": "p", "hash": "0123456789abcdef"}, "start": {"version": "abcdef12"},
            "claims": ["1", "2"], "ndcg@10": [0.1, 0.2], "recall@100": [0.1, 0.2],
            "query_ndcg@10": [0.1, 0.2], **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"served_ndcg@10": [0.5, 1.5]}, "field 'served_ndcg@10'[1] = 1.5 is outside [0, 1]"),
        ({"prf_served_ndcg@10": [0.5]}, "field 'prf_served_ndcg@10' has 1 values for 2 claims"),
        (
            {"eval_metrics": {"degenerate_rate": 1.2}},
            "field 'eval_metrics.degenerate_rate' = 1.2 is outside [0, 1]",
        ),
    ],
)
def test_the_served_ndcg_and_degenerate_rate_are_checked(
    extra: dict[str, Any], message: str
) -> None:
    check_result(_start_file(served_ndcg=None), "ok")  # an unknown key is not checked
    check_result(_start_file(**{"served_ndcg@10": [0.0, 1.0]}), "ok")
    with pytest.raises(ValueError) as info:
        check_result(_start_file(**extra), "pool/start-abcdef12.json")
    assert str(info.value) == f"pool/start-abcdef12.json: {message}"
