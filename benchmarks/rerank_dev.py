"""nDCG@10 of the served second stage (evaluator.rerank) on a BEIR dataset's pooled game.

The pooled game's pool with the keyword-expansion rewrites (evaluator.prf, m rewrites from the
query's top 3 documents): the query's own top k ∪ each rewrite's top k, BM25 unstemmed. Prints
nDCG@10 of the query alone (its own top 10), of the pool's head under the engine's fusion
(``rrf``, merge rule ``pool``) and of the re-ranked pool for each λ (the query's share).
Choose λ on DEV, then report TEST once:

    .venv/bin/python benchmarks/rerank_dev.py --split dev --lambdas 1,0.9,0.8,0.7,0.6,0.5,0.3,0
    .venv/bin/python benchmarks/rerank_dev.py --split test --lambdas 1,0.7
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from evaluator.bm25 import BM25Params, build_or_load_bm25
from evaluator.coalitions import coalition_lists
from evaluator.corpus import load_dataset
from evaluator.prf import KeywordExpansion
from evaluator.rerank import PoolReranker
from evaluator.retrieval_eval import ndcg_recall_at_k


def mean_ndcg(rows: np.ndarray, qrels: list[dict[int, int]], k: int = 10) -> float:
    return float(
        np.mean([ndcg_recall_at_k(list(r), q, k)[0] for r, q in zip(rows, qrels, strict=True)])
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="data/nfcorpus")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--lambdas", default="1,0.9,0.8,0.7,0.6,0.5,0.3,0")
    parser.add_argument("--k", type=int, default=50, help="each list's depth")
    parser.add_argument("--m", type=int, default=4, help="rewrites per query")
    parser.add_argument("--var", default=None, help="index folder (default: a temporary one)")
    args = parser.parse_args()

    dataset = load_dataset(args.dataset, splits=(args.split,))
    var = Path(args.var or tempfile.mkdtemp(prefix="casi-rerank-"))
    index, _ = build_or_load_bm25(dataset.documents, var, BM25Params(stemmer=None))
    qids = dataset.split_query_ids(args.split)
    by_row = dataset.qrels_rows(args.split)
    qrels = [by_row[q] for q in qids]
    texts = [dataset.queries[q] for q in qids]

    own, own_scores = index.retrieve(texts, args.k)  # (Q, k): the anchor
    expansion = KeywordExpansion([d.retrieval_text for d in dataset.documents])
    rewrites = [expansion.rewrites(list(row), args.m) for row in own.tolist()]
    lists = np.full((len(qids), args.m, args.k), -1, dtype=np.int64)
    list_scores = np.zeros((len(qids), args.m, args.k), dtype=np.float32)
    flat = [(i, j, r) for i, rs in enumerate(rewrites) for j, r in enumerate(rs)]
    got, got_scores = index.retrieve([r for _, _, r in flat], args.k)
    for (i, j, _), row, score in zip(flat, got, got_scores, strict=True):
        lists[i, j], list_scores[i, j] = row, np.where(row >= 0, score, 0.0)
    n_actions = torch.tensor([len(rs) for rs in rewrites], dtype=torch.int64)
    fused = coalition_lists(
        torch.from_numpy(lists), torch.from_numpy(list_scores), n_actions, 10,
        anchor_idx=torch.from_numpy(own), anchor_scores=torch.from_numpy(
            np.where(own >= 0, own_scores, 0.0).astype(np.float32)), merge="pool",
    )  # fmt: skip
    pool = np.concatenate([own, lists.reshape(len(qids), -1)], axis=1)
    pool_size = float(np.mean([np.unique(p[p >= 0]).size for p in pool]))
    out: dict[str, object] = {
        "dataset": args.dataset, "split": args.split, "n_queries": len(qids), "k": args.k,
        "m": args.m, "mean_pool_size": round(pool_size, 1), "index_version": index.version,
        "query_alone": round(mean_ndcg(own, qrels), 4),
        "pool_rrf_head": round(mean_ndcg(fused.doc_idx[:, -1].numpy(), qrels), 4),
    }  # fmt: skip
    reranked = {}
    for lam in (float(x) for x in args.lambdas.split(",")):
        start = time.perf_counter()
        rows, _ = PoolReranker(index, lam).rerank(texts, rewrites, pool)
        reranked[f"lambda={lam:g}"] = {
            "ndcg@10": round(mean_ndcg(rows, qrels), 4),
            "seconds": round(time.perf_counter() - start, 2),
        }
    out["reranked"] = reranked
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
