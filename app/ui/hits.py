"""What each rewrite found, for stored credit records: its own top-k list (the documents its
retrieval returned, in its order, with titles and relevance) and its hits in the merged top-K
list of the full coalition N.

A credit record stores the value table, not the lists. The lists are rebuilt the way the
credit path built them: every rewrite (and, with the anchor on, the query) through the SAME
action executor and Redis cache (``ActionExecutor.run``: cache hits, nothing re-embedded when
cached), merged by the ONE list builder (``evaluator.coalitions.coalition_lists``) under the
record's merge rule (``merge``, stored since migration 0004; the server's for an older record).
A hit is marked relevant / not relevant from the qrels of any loaded split, or "unjudged" when
the query has none. A record from another index or embedder than the server's gets no hits
(its lists cannot be rebuilt here), with the reason.

A record of the pooled game (merge ``pool``) also gets who found what: ``record["pool"]``,
the pool's candidates in its order, each with the rewrites whose lists hold it and whether the
query's own list does (:func:`pool_rows`).

Blocking work (retrieval on a cache miss): callers run it in the API's heavy thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from app.db.records import found_by, game_of, pool_summary_of
from app.runtime import Retrieval
from evaluator.coalitions import coalition_lists

MAX_POOL_ROWS = 200  # candidates a pool table shows (its counts cover the whole pool)


def _relevance(retrieval: Retrieval, query_id: str) -> dict[str, int] | None:
    judged: dict[str, int] | None = None
    for split in retrieval.dataset.qrels.values():
        if query_id in split:
            judged = {**(judged or {}), **split[query_id]}
    return judged


def _titles(retrieval: Retrieval) -> dict[str, str]:
    return {d.doc_id: d.title for d in retrieval.dataset.documents}


def unavailable_reason(retrieval: Retrieval | None, record: dict[str, Any]) -> str | None:
    if retrieval is None:
        return "no retrieval stack in this server"
    retriever = retrieval.executor.retriever
    if record["index_version"] != retriever.version:
        return f"recorded on index {record['index_version']}, this server has {retriever.version}"
    if record["embedder_version"] != retriever.encoder_version:
        return f"recorded with embedder {record['embedder_version']}, this server has {retriever.encoder_version}"
    return None


def add_hits(retrieval: Retrieval | None, records: Sequence[dict[str, Any]], list_k: int) -> None:
    """Fill, for every record, in ONE executor batch: ``record["own"]``, one list per rewrite of
    its own top-k (``{doc_id, title, own_rank, rank, relevant}``: rank in the merged list, None
    when the document did not make it), ``record["hits"]`` (the same dicts, only those in the
    merged list) and ``record["merged"]``; or ``record["hits_unavailable"]`` with the reason."""
    todo = []
    for rec in records:
        reason = unavailable_reason(retrieval, rec)
        if reason is None and rec["m"] > 0:
            todo.append(rec)
        else:
            rec["hits_unavailable"] = reason or "no rewrites"
    if not todo or retrieval is None:
        return
    executor = retrieval.executor
    texts = [a for rec in todo for a in rec["actions"]]
    queries = sorted({rec["query_text"] for rec in todo if rec["anchor"]})
    batch = executor.run(texts + queries)
    qpos = {q: len(texts) + i for i, q in enumerate(queries)}
    doc_ids = executor.retriever.doc_ids
    titles = _titles(retrieval)
    start = 0
    for rec in todo:
        m = rec["m"]
        rows = torch.from_numpy(batch.rows[start : start + m][None])  # (1, m, k)
        scores = torch.from_numpy(batch.scores[start : start + m][None])
        start += m
        anchor: dict[str, Any] = {}
        if rec["anchor"]:
            at = qpos[rec["query_text"]]
            anchor = {"anchor_idx": torch.from_numpy(batch.rows[at : at + 1]),
                      "anchor_scores": torch.from_numpy(batch.scores[at : at + 1])}  # fmt: skip
        merge = rec.get("merge") or executor.merge
        lists = coalition_lists(
            rows, scores, torch.tensor([m]), list_k, merge=merge, rrf_k=executor.rrf_k, **anchor,
        )  # fmt: skip
        merged = [int(r) for r in lists.doc_idx[0, -1].tolist() if r >= 0]
        rank = {r: i + 1 for i, r in enumerate(merged)}
        judged = _relevance(retrieval, rec["query_id"])

        def hit(
            row: int, own_rank: int | None = None, judged: dict[str, int] | None = judged,
            rank: dict[int, int] = rank,
        ) -> dict[str, Any]:  # fmt: skip
            did = doc_ids[row]
            rel = None if judged is None else judged.get(did, 0) > 0
            return {"doc_id": did, "title": titles.get(did, ""), "own_rank": own_rank,
                    "rank": rank.get(row), "relevant": rel}  # fmt: skip

        own = rows[0].tolist()
        rec["own"] = [[hit(r, i + 1) for i, r in enumerate(own[j]) if r >= 0] for j in range(m)]
        rec["hits"] = [[h for h in rec["own"][j] if h["rank"] is not None] for j in range(m)]
        rec["merged"] = [hit(r) for r in merged]
        if game_of(merge) == "pool":
            query = anchor["anchor_idx"][0] if anchor else None
            rec["pool"] = pool_rows(rec["merged"], merged, rows[0], query)
        rec["retrieval_k"] = int(rows.shape[-1])
        rec["judged"] = judged is not None
        rec["list_k"] = list_k


def pool_rows(
    docs: list[dict[str, Any]], pool: list[int], rows: torch.Tensor, query: torch.Tensor | None
) -> dict[str, Any]:
    """Who found what: ``docs`` (the pool's documents as :func:`add_hits` shows them, in the
    pool's order), ``pool`` their rows, ``rows`` (m, k) each rewrite's list, ``query`` (k,) the
    query's own list (None with the anchor off) → ``docs``: the first MAX_POOL_ROWS documents,
    each with ``found_by`` (rewrite indices) and ``query`` (bool); and the record's counts
    (``app.db.records.pool_summary_of``: anchor, size, per rewrite new and only)."""
    who = found_by(rows.tolist())
    in_query = set() if query is None else set(query.tolist())
    shown = [{**doc, "found_by": who.get(row, []), "query": row in in_query}
             for doc, row in zip(docs[:MAX_POOL_ROWS], pool, strict=False)]  # fmt: skip
    return {"docs": shown, **pool_summary_of(rows, query)}
