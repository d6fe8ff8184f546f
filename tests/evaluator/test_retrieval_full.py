"""Full SciFact test split with MiniLM + flat inner product: nDCG@10 ≈ 0.645 (slow: embeds the
whole corpus once, ~7 min on 2 cores; the index is cached under var/ for later runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_full_scifact_ndcg_matches_published_baseline() -> None:
    from evaluator.corpus import load_dataset
    from evaluator.embed import Embedder
    from evaluator.index import build_or_load
    from evaluator.retrieval_eval import evaluate_queries

    ds = load_dataset(ROOT / "data" / "scifact")
    embedder = Embedder(max_length=256)
    index, _ = build_or_load(ds.documents, embedder, ROOT / "var")
    res = evaluate_queries(ds, embedder, index, "test", 10)
    assert res["n_queries"] == 300
    assert res["ndcg"] == pytest.approx(0.645, abs=0.01)
