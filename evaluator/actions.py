"""Execute a batch of retrieval actions (query rewrites) through the Redis cache.

Read first: :meth:`ActionExecutor.run`. For n rewrites: normalise → ONE cache read for the
distinct texts → ONE retrieval of all misses (dense: embed in one batch + one FAISS search;
bm25: one bm25s call) → ONE cache write → results in input order. Duplicates inside a batch
are executed once; a damaged cache entry is a miss whose write replaces it. An empty rewrite
retrieves nothing (it is a null player in the credit game).

The executor works with any :class:`evaluator.retrievers.Retriever` (a FAISS ``DocIndex`` is
wrapped with the embedder into the ``dense`` one). It also carries the environment's merge rule
(``max`` | ``rrf``, default: the retriever's) that :func:`evaluator.credit.compute_credits`
uses unless told otherwise.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evaluator.cache import ActionCache
from evaluator.embed import Embedder
from evaluator.index import DocIndex
from evaluator.retrievers import (
    DEFAULT_RRF_K,
    DenseRetriever,
    Retriever,
    check_merge,
    default_merge,
)

QUERY_MEMO_SIZE = 100_000  # ~150 MB of float32 embeddings at most


def normalize_rewrite(text: str) -> str:
    """NFKC, collapse whitespace, lower-case (MiniLM's tokenizer is uncased, so lower-casing
    never changes the embedding but merges cache entries)."""
    return " ".join(unicodedata.normalize("NFKC", text).split()).lower()


@dataclass(frozen=True)
class ActionBatch:
    """Results of n actions, in input order."""

    rows: np.ndarray  # (n, k) int64 index rows, −1 padded
    scores: np.ndarray  # (n, k) float32 inner products (−inf at padding)
    from_cache: np.ndarray  # (n,) bool
    cache_status: str  # "ok" | "degraded"
    stats: dict[str, Any]  # this batch: hits, misses, embedded, unique


class ActionExecutor:
    """Runs rewrites against one retriever and one cache (both built by the caller).

    ``index``: a FAISS :class:`DocIndex` (retrieved through ``embedder``) or any
    :class:`Retriever` (e.g. :class:`evaluator.bm25.BM25Index`). ``embedder`` also embeds user
    queries for the scorers that need them (cosine, surrogate); it may be None otherwise.
    ``merge`` / ``rrf_k``: how coalition lists are merged by default (None: the retriever's rule).
    """

    def __init__(
        self,
        embedder: Embedder | None,
        index: DocIndex | Retriever,
        cache: ActionCache,
        *,
        merge: str | None = None,
        rrf_k: float = DEFAULT_RRF_K,
    ) -> None:
        if isinstance(index, DocIndex):
            if embedder is None:
                raise ValueError("a FAISS index needs the embedder that built it")
            self.retriever: Retriever = DenseRetriever(embedder, index)
        else:
            self.retriever = index
        if (cache.index_version, cache.embedder_version) != (
            self.retriever.version,
            self.retriever.encoder_version,
        ):
            raise ValueError("cache keys must carry the index and embedder versions in use")
        if rrf_k < 0:
            raise ValueError(f"rrf_k must be >= 0, got {rrf_k}")
        self.embedder, self.index, self.cache = embedder, index, cache
        self.merge = check_merge(merge or default_merge(self.retriever.name))
        self.rrf_k = float(rrf_k)
        self.k = cache.k
        self._query_emb: dict[str, np.ndarray] = {}  # in-process memo of query embeddings

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """(n, d) embeddings of user queries, memoised in-process (the same training queries
        come back every step; embedding them again would dominate a warm credit call)."""
        missing = sorted({t for t in texts if t not in self._query_emb})
        if missing and self.embedder is None:
            raise ValueError("this executor has no embedder to embed queries with")
        if missing and self.embedder is not None:
            if len(self._query_emb) + len(missing) > QUERY_MEMO_SIZE:
                self._query_emb.clear()
            self._query_emb.update(zip(missing, self.embedder.encode(missing), strict=True))
        return (
            np.stack([self._query_emb[t] for t in texts]) if texts else np.zeros((0, 0), np.float32)
        )

    def run(self, rewrites: Sequence[str]) -> ActionBatch:
        distinct = {t: normalize_rewrite(t) for t in set(rewrites)}  # normalise each string once
        unique = sorted({t for t in distinct.values() if t})
        slot = {t: i + 1 for i, t in enumerate(unique)}  # slot 0 = the empty rewrite
        where = np.array([slot.get(distinct[t], 0) for t in rewrites], dtype=np.int64)  # (n,)
        got, status = self.cache.get_many(unique)  # (U, k), ONE round trip
        misses = np.flatnonzero(~got.hit)
        if misses.size:
            found = self.retriever.retrieve([unique[i] for i in misses], self.k)  # ONE retrieval
            got.rows[misses], got.scores[misses] = found
            if status == "ok":  # damaged entries are misses too: their write replaces them
                fill = [(unique[i], got.rows[i], got.scores[i]) for i in misses]
                damaged = {unique[i] for i in np.flatnonzero(got.damaged)}
                status = self.cache.put_many(fill, overwrite=damaged)  # ONE round trip
        rows = np.concatenate([np.full((1, self.k), -1, np.int64), got.rows])[where]  # (n, k)
        scores = np.concatenate([np.full((1, self.k), -np.inf, np.float32), got.scores])[where]
        scores[rows < 0] = -np.inf  # short results are −1 padded
        from_cache = np.concatenate([[False], got.hit])[where]
        stats = {
            "unique": len(unique),
            "hits": int(got.hit.sum()),
            "misses": int(misses.size),
            "embedded": int(misses.size),
        }
        return ActionBatch(rows, scores, from_cache, status, stats)
