"""`POST /v1/rewrites`: one request → rows for the batcher → optional retrieval → response.

Read :func:`rewrite`. Generation happens in the batcher's worker thread (`app.workers.batcher`),
retrieval in the API's compute thread; this coroutine only awaits them. The merged list of a
query is built by THE coalition engine (`evaluator.coalitions.coalition_lists`), so its merge
rule (max: best score per document; rrf: reciprocal-rank fusion; ties to the smaller id, top-K)
is the credit path's: the query is the anchor and the merged list is the full coalition's.
In the pooled game (merge rule ``pool``) the merged list is the whole pool, never cut, ranked by
the served second stage on a BM25 index (`evaluator.rerank`: BM25 of the query and the
rewrites' words; each document's score is that stage's), and each item also gets ``pool``: every
candidate with the rewrites that found it (:func:`_pool`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from app.db.records import found_by
from app.errors import InvalidField
from app.runtime import Retrieval
from app.schemas import (
    Document,
    PoolDocument,
    RewriteItem,
    RewriteOut,
    RewriteRequest,
    RewriteResponse,
)
from app.workers.batcher import RewriteBatcher, Row, RowResult
from evaluator.coalitions import coalition_lists
from policy.constrain import DEFAULT_LINE_CAP

RunBlocking = Callable[..., Awaitable[Any]]


def check_texts(field: str, texts: list[str], max_items: int, max_chars: int) -> None:
    """Each text non-blank and ≤ max_chars; at most max_items of them (422 otherwise)."""
    if len(texts) > max_items:
        raise InvalidField(f"body.{field}", f"at most {max_items} items, got {len(texts)}")
    for i, text in enumerate(texts):
        if not text.strip():
            raise InvalidField(f"body.{field}.{i}", "must not be blank")
        if len(text) > max_chars:
            raise InvalidField(f"body.{field}.{i}", f"at most {max_chars} characters")


async def rewrite(
    req: RewriteRequest,
    batcher: RewriteBatcher,
    retrieval: Retrieval,
    run_blocking: RunBlocking,
    *,
    max_queries: int,
    max_chars: int,
    max_new_tokens: int,
    list_k: int,
) -> RewriteResponse:
    check_texts("queries", req.queries, max_queries, max_chars)
    new_tokens = min(req.max_new_tokens or max_new_tokens, max_new_tokens)
    line_cap = req.line_cap or DEFAULT_LINE_CAP
    rows = [
        Row(q, req.n_actions, req.temperature, new_tokens, req.format, line_cap)
        for q in req.queries
    ]
    results, info = await asyncio.wrap_future(batcher.submit(rows))  # Overloaded → 503
    items = [_item(q, r) for q, r in zip(req.queries, results, strict=True)]
    cache = None
    if req.include_results:
        cache = await run_blocking(attach_results, retrieval, items, list_k)
    return RewriteResponse(
        policy_version=results[0].policy_version,
        items=items,
        cache=cache,
        batch_rows=int(info["batch_rows"]),
        queue_wait_ms=1000.0 * info["queue_wait_s"],
    )


def _item(query: str, r: RowResult) -> RewriteItem:
    return RewriteItem(
        query=query,
        rewrites=[
            RewriteOut(
                text=a.text,
                token_start=a.token_start,
                token_end=a.token_end,
                duplicate_of=a.duplicate_of,
            )
            for a in r.parsed.actions
        ],
        status=r.parsed.status,
        finish_reason=r.finish_reason,
        n_tokens=r.n_tokens,
    )


def attach_results(retrieval: Retrieval, items: list[RewriteItem], list_k: int) -> str:
    """Retrieve every rewrite and query in ONE cached batch; fill results + merged in place.
    A degenerate rewrite is played as the empty action, as training's ``refuse_degenerate``
    plays it: it finds nothing and its words do not reach the second stage."""
    played = [["" if rw.degenerate else rw.text for rw in it.rewrites] for it in items]
    texts = [text for item_texts in played for text in item_texts]
    batch = retrieval.executor.run(texts + [it.query for it in items])
    rows, scores = batch.rows, batch.scores  # (n, k)
    reranker = retrieval.reranker() if retrieval.executor.merge == "pool" else None
    start = 0
    for qi, item in enumerate(items):
        m = len(item.rewrites)
        item.results = [_docs(retrieval, rows[start + j], scores[start + j]) for j in range(m)]
        q = len(texts) + qi
        merged = _merge(
            retrieval,
            rows[start : start + m],
            scores[start : start + m],
            rows[q],
            scores[q],
            list_k,
        )
        pool_rows = merged[0][None, merged[0] >= 0]
        if reranker is not None and pool_rows.size:  # the second stage orders the pool (§1.9)
            ranked, ranked_scores = reranker.rerank([item.query], [played[qi]], pool_rows)
            merged = (ranked[0], ranked_scores[0])
        item.merged = _docs(retrieval, *merged)
        if retrieval.executor.merge == "pool":
            item.pool = _pool(item.merged, merged[0], rows[start : start + m], rows[q])
        start += m
    return batch.cache_status


def _pool(
    merged: list[Document], merged_rows: np.ndarray, rows: np.ndarray, q_rows: np.ndarray
) -> list[PoolDocument]:
    """The pool (``merged``, whose real rows are ``merged_rows``) with, per candidate, the
    rewrites whose list ``rows`` (m, k) holds it and whether the query's list ``q_rows`` does."""
    who = found_by(rows.tolist())
    in_query = set(q_rows.tolist())
    real = merged_rows[merged_rows >= 0].tolist()  # the merged documents' rows, in order
    return [
        PoolDocument(**doc.model_dump(), found_by=who.get(row, []), query=row in in_query)
        for doc, row in zip(merged, real, strict=True)
    ]


def _merge(
    retrieval: Retrieval,
    rows: np.ndarray,
    scores: np.ndarray,
    q_rows: np.ndarray,
    q_scores: np.ndarray,
    list_k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Query (the anchor) + all m rewrites: the coalition engine's merged top-K list of the
    full coalition N, under the executor's merge rule (max or rrf), as the credit game merges."""
    m, k = rows.shape[0], q_rows.shape[-1]
    if m == 0:  # a free-format response without rewrites: one padding player (a null player)
        rows, scores = np.full((1, k), -1, dtype=np.int64), np.zeros((1, k), dtype=np.float32)
    lists = coalition_lists(
        torch.from_numpy(rows).reshape(1, max(m, 1), -1),
        torch.from_numpy(scores).reshape(1, max(m, 1), -1),
        torch.tensor([m]),
        list_k,
        anchor_idx=torch.from_numpy(q_rows)[None],
        anchor_scores=torch.from_numpy(q_scores)[None],
        merge=retrieval.executor.merge,
        rrf_k=retrieval.executor.rrf_k,
    )
    return lists.doc_idx[0, -1].numpy(), lists.scores[0, -1].numpy()


def _docs(retrieval: Retrieval, rows: np.ndarray, scores: np.ndarray) -> list[Document]:
    docs = retrieval.dataset.documents
    return [
        Document(id=docs[int(r)].doc_id, title=docs[int(r)].title, score=float(s))
        for r, s in zip(rows, scores, strict=True)
        if r >= 0
    ]
