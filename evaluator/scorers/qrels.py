"""Positive relevance judgments (qrels) in a batched-lookup form, and IDCG@K.

Read :meth:`QrelsTable.from_dict`, then :meth:`QrelsTable.grades_at` (one ``searchsorted``
for a whole (N, K) batch of lists: no Python loop over lists at score time).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from evaluator.scorers.base import discounts, stable_hash

__all__ = ["QrelsTable", "ideal_dcg"]

_KEY_STRIDE = 1 << 32
"""Qrels lookup key = query_index · 2^32 + doc_row: unique for rows < 2^32, queries < 2^31."""


@dataclass(frozen=True)
class QrelsTable:
    """Positive judgments in a batched-lookup form (no Python loop over lists at score time).

    A query is *judged* iff it has at least one judgment with relevance > 0; judgments with
    relevance ≤ 0 are dropped (they add no gain). Build with :meth:`from_dict`.

    Attributes:
        query_ids: judged query ids; position = query index.
        keys: (P,) int64 sorted lookup keys ``query_index · 2^32 + doc_row``.
        grades: (P,) int64 relevance (> 0) aligned with ``keys``.
        ideal: (Q, R_max) int64 grades of each query sorted descending, 0-padded.
        fingerprint: content hash of the judgments.
    """

    query_ids: tuple[str, ...]
    keys: Tensor
    grades: Tensor
    ideal: Tensor
    fingerprint: str

    @classmethod
    def from_dict(cls, qrels: Mapping[str, Mapping[int, int]]) -> QrelsTable:
        """Build from ``{query_id: {doc_row: relevance}}``."""
        positive = {
            qid: sorted((int(row), int(rel)) for row, rel in docs.items() if rel > 0)
            for qid, docs in sorted(qrels.items())
        }
        positive = {qid: docs for qid, docs in positive.items() if docs}
        query_ids = tuple(positive)
        keys: list[int] = []
        grades: list[int] = []
        r_max = max((len(docs) for docs in positive.values()), default=0)
        ideal = torch.zeros((len(query_ids), r_max), dtype=torch.int64)
        for qi, qid in enumerate(query_ids):
            docs = positive[qid]
            if docs[0][0] < 0 or docs[-1][0] >= _KEY_STRIDE:
                raise ValueError(f"query {qid!r}: document rows must be in [0, 2^32)")
            keys.extend(qi * _KEY_STRIDE + row for row, _ in docs)
            grades.extend(rel for _, rel in docs)
            ideal[qi, : len(docs)] = torch.tensor(sorted((rel for _, rel in docs), reverse=True))
        canonical = json.dumps([[qid, positive[qid]] for qid in query_ids])
        return cls(
            query_ids=query_ids,
            keys=torch.tensor(keys, dtype=torch.int64),  # sorted: qi-major, rows sorted
            grades=torch.tensor(grades, dtype=torch.int64),
            ideal=ideal,
            fingerprint=stable_hash("qrels", canonical),
        )

    def to(self, device: torch.device | str) -> QrelsTable:
        return QrelsTable(
            self.query_ids,
            self.keys.to(device),
            self.grades.to(device),
            self.ideal.to(device),
            self.fingerprint,
        )

    @cached_property
    def position(self) -> dict[str, int]:
        """query id → query index (built once)."""
        return {qid: i for i, qid in enumerate(self.query_ids)}

    def indices(self, query_ids: Sequence[str], *, allow_unjudged: bool = False) -> Tensor:
        """(Q,) int64 query indices; −1 for unjudged ids if allowed, else ValueError naming them."""
        idx = [self.position.get(qid, -1) for qid in query_ids]
        missing = sorted({qid for qid, i in zip(query_ids, idx, strict=True) if i < 0})
        if missing and not allow_unjudged:
            shown = ", ".join(repr(q) for q in missing[:10])
            raise ValueError(
                f"{len(missing)} unjudged queries (no relevance > 0 in qrels): {shown}"
                f"{' ...' if len(missing) > 10 else ''}. Score judged queries only, or pass "
                "allow_unjudged=True to score them 0."
            )
        return torch.tensor(idx, dtype=torch.int64, device=self.keys.device)

    def grades_at(self, qidx: Tensor, lists: Tensor) -> Tensor:
        """Relevance grade of every slot: qidx (N,), lists (N, K) → (N, K) int64 (0 if none)."""
        if self.keys.numel() == 0:
            return torch.zeros_like(lists)
        keys = qidx[:, None] * _KEY_STRIDE + lists  # (N, K); negative for qidx −1 → no match
        pos = torch.searchsorted(self.keys, keys).clamp(max=self.keys.numel() - 1)
        hit = (self.keys[pos] == keys) & (lists >= 0) & (qidx[:, None] >= 0)
        return torch.where(hit, self.grades[pos], torch.zeros_like(lists))


def ideal_dcg(table: QrelsTable, k: int) -> Tensor:
    """IDCG@K of every judged query → (Q_judged,) float64 (> 0)."""
    ideal = table.ideal[:, :k].to(torch.float64)  # (Q, min(R_max, K))
    disc = discounts(ideal.shape[1], table.ideal.device)
    return ((torch.exp2(ideal) - 1.0) * disc).sum(-1)
