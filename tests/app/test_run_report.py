"""`casi report run`'s curves and summary (app/reports/run.py), from plain data: a run in the list
game reports nDCG@10; one in the pooled game also reports its own value, graded pool recall,
beside the equal budget and keyword expansion, and says when the rewrites waste their budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.reports import run as report

RUN = {"id": 3, "name": "demo-pool", "status": "finished", "preset": "casi",
       "config": {"evaluator": "replay", "train": {}}}  # fmt: skip
STEPS = [{"step": s, "metrics": {"reward_mean": 0.2 + s / 10, "gain_mean": 0.05, "time/step_s": 15.0}}
         for s in (1, 2)]  # fmt: skip
LIST = {"query_ndcg@10": 0.3127, "combined_ndcg@10": 0.2896, "gain_ndcg@10": -0.0231,
        "combined_recall@100": 0.2668, "well_formed": 1.0, "duplicate_rate": 0.5375}  # fmt: skip


def _pooled(step: int, pool: float) -> dict[str, Any]:
    metrics = {**LIST, "combined_pool_recall": pool, "query_pool_recall": 0.2466,
               "budget_pool_recall": 0.3510, "prf_pool_recall": 0.3840, "overlap": 0.8594}  # fmt: skip
    return {"step": step, "split": "test", "n_queries": 40, "metrics": metrics}


def test_a_list_game_run_reports_ndcg_only(tmp_path: Path) -> None:
    evals = [{"step": 0, "split": "test", "n_queries": 40, "metrics": LIST}]
    png, md = report.write_run_report(RUN, STEPS, evals, tmp_path)
    text = md.read_text()
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "| 0 | test | 40 | 0.3127 | 0.2896 | -0.0231 | 0.2668 | 100% |" in text
    assert "pool recall" not in text
    assert report._heldout_panel(evals) == report.HELDOUT_LIST


def test_a_pooled_game_run_reports_its_pool_recall_against_the_equal_budget(tmp_path: Path) -> None:
    evals = [_pooled(0, 0.2704), _pooled(8, 0.3612)]
    png, md = report.write_run_report(RUN, STEPS, evals, tmp_path)
    text = md.read_text()
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "| 0 | 0.2704 | 0.2466 | 0.3510 | 0.3840 | 0.8594 | 0.5375 | wastes its budget |" in text
    assert (
        "| 8 | 0.3612 | 0.2466 | 0.3510 | 0.3840 | 0.8594 | 0.5375 | beats the equal budget |"
        in text
    )
    assert report._heldout_panel(evals) == report.HELDOUT_POOL
    # the panel draws every curve it names: each is in every pooled evaluation
    assert all(key in e["metrics"] for key, _ in report.HELDOUT_POOL[1] for e in evals)
