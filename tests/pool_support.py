"""Helpers of the pooled game's product-mode tests (tests/api/test_pool_rewrites.py,
tests/ui/test_pool_explorer.py): rewrites with a copy, and each text's own list as the executor
returns it (what the expected pools are computed from)."""

from __future__ import annotations

from typing import Any


def opening_rewrites(dataset: Any) -> tuple[str, list[str]]:
    """The first judged TRAIN query and four rewrites: a relevant document's first words twice
    (a copy; the NFCorpus documents have no titles), the query's first words, a line about
    nothing in the corpus."""
    qid = dataset.split_query_ids("train")[0]
    texts = {d.doc_id: d.text for d in dataset.documents}
    relevant = next(d for d, g in dataset.qrels["train"][qid].items() if g > 0 and d in texts)
    opening = " ".join(texts[relevant].split()[:8])
    return qid, [opening, opening, " ".join(dataset.queries[qid].split()[:3]), "zebra migration"]


def doc_lists(retrieval: Any, texts: list[str]) -> list[list[str]]:
    """Each text's own top-k as document ids, straight from the executor (cache and index)."""
    ids = retrieval.executor.retriever.doc_ids
    return [[ids[int(r)] for r in row if r >= 0] for row in retrieval.executor.run(texts).rows]
