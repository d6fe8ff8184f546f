"""Plain-query retrieval metrics (nDCG@k, recall@k) — the sanity baseline of the index."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from evaluator.corpus import Dataset
from evaluator.embed import Embedder
from evaluator.index import DocIndex


def ndcg_recall_at_k(ranked: list[int], rels: dict[int, int], k: int) -> tuple[float, float]:
    """nDCG@k with gains 2^rel − 1 and recall@k of one ranked list of rows."""
    dcg = sum((2 ** rels.get(r, 0) - 1) / math.log2(i + 2) for i, r in enumerate(ranked[:k]))
    ideal = sorted(rels.values(), reverse=True)[:k]
    idcg = sum((2**g - 1) / math.log2(i + 2) for i, g in enumerate(ideal))
    found = sum(1 for r in ranked[:k] if rels.get(r, 0) > 0)
    n_rel = sum(1 for g in rels.values() if g > 0)
    return (dcg / idcg if idcg else 0.0), (found / n_rel if n_rel else 0.0)


def evaluate_queries(
    dataset: Dataset, embedder: Embedder, index: DocIndex, split: str, k: int
) -> dict[str, Any]:
    """Mean nDCG@k / recall@k over the judged queries of ``split`` (relevance by index row)."""
    qrels = dataset.qrels_rows(split)
    qids = [q for q in dataset.split_query_ids(split)]
    emb = embedder.encode([dataset.queries[q] for q in qids])
    rows, _ = index.search(emb, k)
    scores = np.array([ndcg_recall_at_k(list(rows[i]), qrels[q], k) for i, q in enumerate(qids)])
    return {
        "n_queries": len(qids),
        "ndcg": float(scores[:, 0].mean()),
        "recall": float(scores[:, 1].mean()),
    }
