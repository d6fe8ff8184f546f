"""The served second stage of the pooled game: re-rank the pool by BM25 of an expanded query.

Read :class:`PoolReranker`, then :meth:`PoolReranker.rerank`.

In the pooled game (docs/methods.md §1.8) the reward is graded recall of the *pool*, the union
of the query's own top k and every rewrite's top k; a user is served a ranked list. The pool's
head under the engine's fusion (``rrf``) lets the rewrites' lists push the query's best
documents down; this stage ranks the pool instead by BM25 of one **expanded query**, as RM3
does (docs/methods.md §1.9): the query's own terms plus the rewrites' words, the rewrites'
words weighted down.

**Formula** (RM3's interpolation). Tokenize the query and the rewrites with the index's own
tokenizer (:func:`evaluator.bm25.tokenize`, so terms match the index) and keep the tokens the
index's vocabulary holds. With c_Q(w) the count of w in the query's tokens, c_E(w) its count
over all the rewrites' tokens together, and λ = ``query_weight`` ∈ [0, 1]:

    θ(w) = λ · c_Q(w) / Σ_v c_Q(v)  +  (1 − λ) · c_E(w) / Σ_v c_E(v)

(a part whose tokens are all unknown, or absent, contributes 0), and a pool document d scores

    s(d) = Σ_w θ(w) · idf(w) · tf(w, d) / (tf(w, d) + k1 · (1 − b + b · |d| / avgdl))

with idf(w) = ln(1 + (N − df(w) + 0.5) / (df(w) + 0.5)): bm25s's ``lucene`` variant with the
index's k1 / b, read straight from its precomputed term × document score matrix (float32
entries; the sum is taken in float64, then rounded to float32). λ = 1 is the query's own BM25
up to the factor 1 / Σ c_Q, so the order of the pool is the query's own order; a word in both
the query and the rewrites gets both shares.

**Output**: every distinct document of the pool (−1 padding and repeats dropped), ranked by
score descending, equal float32 scores by the smaller row; documents outside the pool are never
returned, and pool documents that share no term with the expanded query still are (score 0,
last). Rows are −1 padded and scores −inf padded to the pool's width, as
:meth:`evaluator.bm25.BM25Index.retrieve` pads. A query whose pool row is all padding (nothing
retrieved) gets an all-padding row. The version hashes the formula, λ and the index version
(:attr:`PoolReranker.version`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from evaluator.bm25 import BM25Index, tokenize

__all__ = ["DEFAULT_QUERY_WEIGHT", "RERANKER_NAME", "PoolReranker", "expansion_weights"]

RERANKER_NAME = "bm25-rm3"

DEFAULT_QUERY_WEIGHT = 0.8
"""λ, the query's share of the expanded query; chosen on NFCorpus DEV (docs/methods.md §1.9):
with the keyword-expansion rewrites (m = 4, k = 50) nDCG@10 0.2909 at λ = 0.8, the best of
λ ∈ {1, 0.9, …, 0.2, 0} (query alone 0.2761, λ = 1 0.2774, λ = 0 0.2673)."""


def expansion_weights(
    query: Sequence[str], expansion: Sequence[str], query_weight: float
) -> dict[str, float]:
    """θ(w) of the module docstring from the query's and the rewrites' (known) tokens."""
    weights: dict[str, float] = {}
    for tokens, share in ((query, query_weight), (expansion, 1.0 - query_weight)):
        if not tokens or share == 0:
            continue
        counts = Counter(tokens)
        total = sum(counts.values())
        for word, count in counts.items():
            weights[word] = weights.get(word, 0.0) + share * count / total
    return weights


@dataclass(frozen=True)
class PoolReranker:
    """Ranks a pool of index rows for a query by BM25 of its expanded query (module docstring).

    ``index``: the game's own BM25 index; ``query_weight``: λ ∈ [0, 1] (1: the query alone)."""

    index: BM25Index
    query_weight: float = DEFAULT_QUERY_WEIGHT

    def __post_init__(self) -> None:
        if not 0.0 <= self.query_weight <= 1.0:
            raise ValueError(
                f"query_weight (λ, the query's share) must be in [0, 1], got {self.query_weight}"
            )

    @property
    def version(self) -> str:
        """Hash of the formula, λ and the index version."""
        text = f"{RERANKER_NAME}|rm3-interpolation|lambda={float(self.query_weight)!r}|{self.index.version}"
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def _check(
        self, queries: Sequence[str], rewrites: Sequence[Sequence[str]], pool: np.ndarray
    ) -> np.ndarray:
        if isinstance(rewrites, str) or any(isinstance(r, str) for r in rewrites):
            raise ValueError("rewrites must hold one sequence of rewrite texts per query")
        pool = np.asarray(pool)
        if pool.ndim != 2 or pool.shape[0] != len(queries) or len(rewrites) != len(queries):
            raise ValueError(
                f"pool must be (n_queries, width) with one query and one list of rewrites per "
                f"row; got pool {pool.shape}, {len(queries)} queries, {len(rewrites)} rewrite lists"
            )
        if pool.shape[1] == 0:
            raise ValueError("the pool is empty (width 0): nothing to rank")
        if not np.issubdtype(pool.dtype, np.integer):
            raise ValueError(f"pool rows must be integers, got {pool.dtype}")
        bad = (pool < -1) | (pool >= len(self.index))
        if bad.any():
            raise ValueError(
                f"pool holds unknown rows (valid: 0..{len(self.index) - 1}, −1 = padding): "
                f"{sorted(set(pool[bad].tolist()))[:5]}"
            )
        return pool.astype(np.int64, copy=False)

    def rerank(
        self, queries: Sequence[str], rewrites: Sequence[Sequence[str]], pool: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(rows (n, P) int64 best first, −1 padded; scores (n, P) float32, −inf padded).

        ``queries``: n query texts; ``rewrites``: per query its rewrites' texts (any number,
        none included); ``pool``: (n, P) index rows, −1 padding, repeats allowed (e.g. the
        anchor's and the rewrites' lists side by side). ValueError on a width-0 pool, a row
        outside the index or mismatched lengths."""
        pool = self._check(queries, rewrites, pool)
        n, width = pool.shape
        rows = np.full((n, width), -1, dtype=np.int64)
        scores = np.full((n, width), -np.inf, dtype=np.float32)
        if n == 0:
            return rows, scores
        expansions = [" ".join(r) for r in rewrites]
        tokens = tokenize([*queries, *expansions], self.index.params)  # one batched call
        model = self.index.model
        vocab: dict[str, int] = model.vocab_dict
        matrix = model.scores
        data, indices, indptr = matrix["data"], matrix["indices"], matrix["indptr"]
        for i in range(n):
            candidates = np.unique(pool[i][pool[i] >= 0])  # sorted, distinct
            if candidates.size == 0:
                continue
            known_q = [t for t in tokens[i] if t in vocab]
            known_e = [t for t in tokens[n + i] if t in vocab]
            theta = expansion_weights(known_q, known_e, self.query_weight)
            total = np.zeros(candidates.size, dtype=np.float64)
            for word in sorted(theta, key=vocab.__getitem__):  # a fixed summation order
                term = vocab[word]
                docs = indices[indptr[term] : indptr[term + 1]]
                at = np.searchsorted(candidates, docs)
                at[at == candidates.size] = 0
                hit = candidates[at] == docs
                total[at[hit]] += theta[word] * data[indptr[term] : indptr[term + 1]][hit]
            got = total.astype(np.float32)
            order = np.lexsort((candidates, -got))  # score descending, then row ascending
            rows[i, : candidates.size] = candidates[order]
            scores[i, : candidates.size] = got[order]
        return rows, scores
