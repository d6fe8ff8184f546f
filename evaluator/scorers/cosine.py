"""``cosine``: zero-shot soft DCG, no fitting.

gain_r = max(0, cos(q, d_r)); value = Σ_{r≤K} gain_r / log2(r + 1) divided by the same sum
with every gain = 1, so v ∈ [0, 1]; an all-padding list scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from evaluator.scorers.base import (
    DEFAULT_CHUNK,
    SetScorer,
    check_lists,
    chunked,
    discounts,
    gather_docs,
    stable_hash,
    tensor_fingerprint,
)
from evaluator.scorers.registry import ScorerSpec, need, register_scorer

__all__ = ["CosineScorer"]


class CosineScorer:
    """Zero-shot soft DCG of max(0, cos) gains, normalised by Σ_{r≤K} 1/log2(r+1) → [0, 1]."""

    name = "cosine"
    uses_query_emb = True

    def __init__(
        self,
        doc_emb: Tensor,
        *,
        k: int,
        device: torch.device | str = "cpu",
        chunk: int = DEFAULT_CHUNK,
        doc_fingerprint: str | None = None,
    ) -> None:
        if k < 1 or chunk < 1:
            raise ValueError(f"k and chunk must be ≥ 1, got k={k}, chunk={chunk}")
        self.k, self.chunk, self.device = k, chunk, torch.device(device)
        self.doc_emb = doc_emb.to(self.device, torch.float32)
        fingerprint = doc_fingerprint or tensor_fingerprint(doc_emb)
        self.version = stable_hash("cosine", str(k), fingerprint)
        self.norm = discounts(k, self.device).sum()

    def score(self, query_ids: Sequence[str], query_emb: Tensor, lists: Tensor) -> Tensor:
        lists_k = check_lists(query_ids, query_emb, lists, self.k).to(self.device)
        q, c, kk = lists_k.shape
        flat = lists_k.reshape(q * c, kk)  # (Q·C, K)
        flat_q = query_emb.to(self.device, torch.float32).repeat_interleave(c, dim=0)
        return chunked(self.values, self.chunk, flat_q, flat).reshape(q, c).to(lists.device)

    def values(self, query_emb: Tensor, lists: Tensor) -> Tensor:
        """query_emb (N, d), lists (N, K) → (N,) float64 soft DCG in [0, 1]."""
        docs, mask = gather_docs(self.doc_emb, lists)  # (N, K, d), (N, K)
        cos = (docs * query_emb[:, None, :]).sum(-1).to(torch.float64)  # (N, K)
        gains = cos.clamp(min=0.0) * mask
        return (gains * discounts(lists.shape[1], self.device)).sum(-1) / self.norm


@register_scorer("cosine")
def _build_cosine(spec: ScorerSpec) -> SetScorer:
    return CosineScorer(
        need(spec.doc_emb, "doc_emb", "cosine"),
        k=spec.k,
        device=spec.device,
        chunk=spec.chunk,
        doc_fingerprint=spec.doc_fingerprint,
    )
