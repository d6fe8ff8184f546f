"""Plain-query retrieval metrics (nDCG@k, recall@k) — the sanity baseline of an index.

Read first: :func:`evaluate_retriever` (any :class:`~evaluator.retrievers.Retriever`: dense or
bm25). Gains are graded: a judgment of grade g adds 2^g − 1 (binary qrels: 1), the same gain
as the replay evaluator (:mod:`evaluator.scorers.replay`). Note BEIR's published tables use
``pytrec_eval``'s linear gain g: identical on binary qrels (SciFact), different on graded ones.

Against trec_eval (tests/evaluator/test_trec_parity.py, to 1e-6): recall@k is the same
definition (relevant found in the top k / all relevant judged, grade > 0); nDCG@k equals
trec_eval's ``ndcg_cut.k`` on qrels whose grades are mapped g → 2^g − 1 (the gain is the one
difference). What is scored differs twice: trec_eval re-sorts a run by score, ties by document
id descending, where these functions take a ranked list (the retrievers rank ties by the smaller
row); and trec_eval without ``-c`` averages over the queries the run has, these functions over
every query of the split (nothing retrieved: 0).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from evaluator.corpus import Dataset
from evaluator.embed import Embedder
from evaluator.index import DocIndex
from evaluator.retrievers import DenseRetriever, Retriever


def ndcg_recall_at_k(ranked: list[int], rels: dict[int, int], k: int) -> tuple[float, float]:
    """nDCG@k with gains 2^rel − 1 and recall@k of one ranked list of rows (−1 = no document)."""
    dcg = sum((2 ** rels.get(r, 0) - 1) / math.log2(i + 2) for i, r in enumerate(ranked[:k]))
    ideal = sorted(rels.values(), reverse=True)[:k]
    idcg = sum((2**g - 1) / math.log2(i + 2) for i, g in enumerate(ideal))
    found = sum(1 for r in ranked[:k] if rels.get(r, 0) > 0)
    n_rel = sum(1 for g in rels.values() if g > 0)
    return (dcg / idcg if idcg else 0.0), (found / n_rel if n_rel else 0.0)


def evaluate_retriever(
    dataset: Dataset, retriever: Retriever, split: str, k: int = 10, recall_k: int | None = None
) -> dict[str, Any]:
    """Mean nDCG@k / recall@k (and recall@recall_k when given) of the plain queries of
    ``split`` (relevance by index row). Queries with no judged document left in the corpus
    slice count 0; a split with no positive judgment at all is refused by the dataset
    (:meth:`~evaluator.corpus.Dataset.check_split`: DatasetError naming its qrels file)."""
    qrels = dataset.qrels_rows(split)
    qids = dataset.split_query_ids(split)
    depth = max(k, recall_k or k)
    rows, _ = retriever.retrieve([dataset.queries[q] for q in qids], depth)
    at_k = np.array([ndcg_recall_at_k(list(rows[i]), qrels[q], k) for i, q in enumerate(qids)])
    out: dict[str, Any] = {
        "n_queries": len(qids),
        "ndcg": float(at_k[:, 0].mean()),
        "recall": float(at_k[:, 1].mean()),
        "retriever": retriever.name,
        "index_version": retriever.version,
    }
    if recall_k is not None:
        deep = [ndcg_recall_at_k(list(rows[i]), qrels[q], recall_k)[1] for i, q in enumerate(qids)]
        out[f"recall@{recall_k}"] = float(np.mean(deep))
    return out


def evaluate_queries(
    dataset: Dataset, embedder: Embedder, index: DocIndex, split: str, k: int
) -> dict[str, Any]:
    """:func:`evaluate_retriever` of the dense retriever (embedder + FAISS index)."""
    return evaluate_retriever(dataset, DenseRetriever(embedder, index), split, k)
