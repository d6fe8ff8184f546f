"""What every set scorer shares: the :class:`SetScorer` protocol and small batched helpers.

Conventions shared by all scorers (see :mod:`evaluator.scorers` for the scorers themselves):

- ``score(query_ids, query_emb (Q, d), lists (Q, C, K'))`` → (Q, C) float64 in one batched
  computation over the Q·C lists (chunked to bound memory);
- rank r = column index + 1; padding (−1) contributes nothing, wherever it sits;
- lists longer than K are truncated to their first K columns;
- lists are assumed DUPLICATE-FREE (coalition merges dedupe); a duplicated relevant row is
  counted twice, so nDCG could exceed 1 — this is not checked (it would cost a sort per call);
- values are computed on the scorer's configured device and returned on ``lists.device``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_CHUNK",
    "PAD",
    "SetScorer",
    "check_lists",
    "chunked",
    "discounts",
    "gather_docs",
    "stable_hash",
    "tensor_fingerprint",
]

PAD = -1
"""Row id of a padding slot."""

DEFAULT_CHUNK = 8192
"""Lists scored per forward chunk: cosine/surrogate gather (chunk, K, d) float32 embeddings,
8192 × 10 × 384 × 4 B ≈ 126 MB at K = 10."""


@runtime_checkable
class SetScorer(Protocol):
    """v(query, list) for a batch. ``version`` hashes everything that determines the outputs."""

    name: str
    version: str
    uses_query_emb: bool
    """False when ``score`` never reads ``query_emb`` (callers may then skip embedding)."""

    def score(self, query_ids: Sequence[str], query_emb: Tensor, lists: Tensor) -> Tensor:
        """query_emb (Q, d), lists (Q, C, K') int64 rows with −1 padding → (Q, C) float64."""
        ...


def stable_hash(*parts: str) -> str:
    """Short (16 hex) sha256 of the parts, separated so that ("ab", "c") ≠ ("a", "bc")."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\x00")
    return digest.hexdigest()[:16]


def tensor_fingerprint(t: Tensor) -> str:
    """Content hash of a tensor: shape, dtype and raw bytes (≈ 20 ms for 5183 × 384 float32)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    digest = hashlib.sha256(f"{tuple(t.shape)}|{t.dtype}".encode())
    digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def discounts(k: int, device: torch.device | str = "cpu") -> Tensor:
    """1 / log2(r + 1) for ranks r = 1..k → (k,) float64."""
    ranks = torch.arange(1, k + 1, dtype=torch.float64, device=device)
    return 1.0 / torch.log2(ranks + 1.0)


def chunked(fn: Callable[..., Tensor], chunk: int, *args: Tensor) -> Tensor:
    """Apply ``fn`` to row chunks of ``args`` (same first dim N) and concatenate → (N, ...)."""
    n = args[0].shape[0]
    parts = [fn(*(a[i : i + chunk] for a in args)) for i in range(0, n, chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=args[0].device)


def check_lists(query_ids: Sequence[str], query_emb: Tensor, lists: Tensor, k: int) -> Tensor:
    """Validate the shapes of a score() call; return lists truncated to K columns (Q, C, ≤K)."""
    if lists.ndim != 3:
        raise ValueError(f"lists must be (Q, C, K) int64 rows, got shape {tuple(lists.shape)}")
    if lists.dtype != torch.int64:
        raise ValueError(f"lists must be int64 document rows, got {lists.dtype}")
    if query_emb.ndim != 2 or query_emb.shape[0] != lists.shape[0]:
        raise ValueError(
            f"query_emb must be (Q, d) with Q = {lists.shape[0]} (lists), "
            f"got {tuple(query_emb.shape)}"
        )
    if len(query_ids) != lists.shape[0]:
        raise ValueError(f"{len(query_ids)} query_ids for {lists.shape[0]} rows of lists")
    return lists[..., :k]


def gather_docs(doc_emb: Tensor, lists: Tensor) -> tuple[Tensor, Tensor]:
    """lists (N, K) rows → embeddings (N, K, d) (padding gathers row 0) and mask (N, K) bool."""
    if lists.numel() and int(lists.max()) >= doc_emb.shape[0]:
        raise ValueError(f"document row {int(lists.max())} ≥ n_docs = {doc_emb.shape[0]}")
    mask = lists >= 0
    return doc_emb[lists.clamp(min=0)], mask
