"""``replay``: nDCG@K (default), recall@K or graded recall@K of each list against qrels — the
ground truth.

Gain of grade g is 2^g − 1 (binary qrels: 1); DCG = Σ_r gain_r / log2(r + 1); IDCG from the
query's ideal ranking truncated at K. Recall@K = relevant docs in the top K / all relevant
docs of the query (the BEIR / pytrec_eval denominator, not min(R, K)). Graded recall@K = the sum
of the grades of the relevant docs in the top K / the sum of all the query's grades (the value
of the pooled game, :mod:`evaluator.games`; with binary qrels it is recall@K). An all-padding
list (the empty coalition) scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import torch
from torch import Tensor

from evaluator.scorers.base import (
    DEFAULT_CHUNK,
    SetScorer,
    check_lists,
    chunked,
    discounts,
    stable_hash,
)
from evaluator.scorers.qrels import QrelsTable, ideal_dcg
from evaluator.scorers.registry import Metric, ScorerSpec, need, register_scorer

__all__ = ["METRICS", "ReplayScorer"]

METRICS = get_args(Metric)
"""The replay metrics: ndcg, recall, graded_recall."""


class ReplayScorer:
    """nDCG@K, recall@K or graded recall@K of each list against qrels (the ground truth)."""

    name = "replay"
    uses_query_emb = False

    def __init__(
        self,
        qrels: QrelsTable,
        *,
        k: int,
        metric: Metric = "ndcg",
        allow_unjudged: bool = False,
        device: torch.device | str = "cpu",
        chunk: int = DEFAULT_CHUNK,
    ) -> None:
        if k < 1 or chunk < 1:
            raise ValueError(f"k and chunk must be ≥ 1, got k={k}, chunk={chunk}")
        if metric not in METRICS:
            raise ValueError(f"unknown replay metric {metric!r}; valid: {', '.join(METRICS)}")
        self.k, self.metric, self.allow_unjudged, self.chunk = k, metric, allow_unjudged, chunk
        self.device = torch.device(device)
        self.qrels = qrels.to(self.device)
        self.idcg = ideal_dcg(self.qrels, k)  # (Q_judged,)
        self.n_relevant = (self.qrels.ideal > 0).sum(-1).to(torch.float64)  # (Q_judged,)
        self.grade_total = self.qrels.ideal.sum(-1).to(torch.float64)  # (Q_judged,) Σ grades
        self.version = stable_hash("replay", qrels.fingerprint, metric, str(k))

    def score(self, query_ids: Sequence[str], query_emb: Tensor, lists: Tensor) -> Tensor:
        lists_k = check_lists(query_ids, query_emb, lists, self.k).to(self.device)
        q, c, kk = lists_k.shape
        qidx = self.qrels.indices(query_ids, allow_unjudged=self.allow_unjudged)
        flat_q, flat = qidx.repeat_interleave(c), lists_k.reshape(q * c, kk)  # (Q·C,), (Q·C, K)
        return chunked(self.values, self.chunk, flat_q, flat).reshape(q, c).to(lists.device)

    def values(self, qidx: Tensor, lists: Tensor) -> Tensor:
        """qidx (N,) judged-query indices (−1 → value 0), lists (N, K) → (N,) float64."""
        grades = self.qrels.grades_at(qidx, lists).to(torch.float64)  # (N, K)
        safe = qidx.clamp(min=0)
        judged = qidx >= 0
        if self.metric == "recall":
            found = (grades > 0).sum(-1).to(torch.float64)
            return torch.where(judged, found / self.n_relevant[safe], 0.0)
        if self.metric == "graded_recall":
            return torch.where(judged, grades.sum(-1) / self.grade_total[safe], 0.0)
        dcg = ((torch.exp2(grades) - 1.0) * discounts(lists.shape[1], self.device)).sum(-1)
        return torch.where(judged, dcg / self.idcg[safe], 0.0)


@register_scorer("replay")
def _build_replay(spec: ScorerSpec) -> SetScorer:
    return ReplayScorer(
        need(spec.qrels, "qrels", "replay"),
        k=spec.k,
        metric=spec.metric,
        allow_unjudged=spec.allow_unjudged,
        device=spec.device,
        chunk=spec.chunk,
    )
