"""Set-level evaluators v(query, list) behind one protocol (METHODS §1, "Evaluators").

Read :func:`make_scorer` first, then :meth:`ReplayScorer.score`.

Every scorer maps a batch ``lists`` (Q, C, K') of document ROWS (int64, −1 padding) to values
(Q, C) float64 in one batched computation over the Q·C lists (chunked to bound memory):

- ``replay``: nDCG@K (default) or recall@K against qrels — the ground truth. Gain of grade g
  is 2^g − 1 (binary qrels: 1); DCG = Σ_r gain_r / log2(r + 1); IDCG from the query's ideal
  ranking truncated at K. Recall@K = relevant docs in the top K / all relevant docs of the
  query (the BEIR / pytrec_eval denominator, not min(R, K)).
- ``cosine``: zero-shot soft DCG, no fitting: gain_r = max(0, cos(q, d_r)), value =
  Σ_{r≤K} gain_r / log2(r + 1) divided by the same sum with every gain = 1, so v ∈ [0, 1].
- ``surrogate``: the frozen neural set scorer of :mod:`evaluator.surrogate`.

Conventions shared by all scorers:

- rank r = column index + 1; padding (−1) contributes nothing, wherever it sits;
- lists longer than K are truncated to their first K columns;
- lists are assumed DUPLICATE-FREE (coalition merges dedupe); a duplicated relevant row is
  counted twice, so nDCG could exceed 1 — this is not checked (it would cost a sort per call);
- an all-padding list (the empty coalition) scores 0 for replay and cosine;
- values are computed on the scorer's configured device and returned on ``lists.device``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_CHUNK",
    "PAD",
    "CosineScorer",
    "QrelsTable",
    "ReplayScorer",
    "ScorerSpec",
    "SetScorer",
    "check_lists",
    "chunked",
    "discounts",
    "make_scorer",
    "register_scorer",
    "registered_scorers",
    "stable_hash",
    "tensor_fingerprint",
]

PAD = -1
"""Row id of a padding slot."""

DEFAULT_CHUNK = 8192
"""Lists scored per forward chunk: cosine/surrogate gather (chunk, K, d) float32 embeddings,
8192 × 10 × 384 × 4 B ≈ 126 MB at K = 10."""

_KEY_STRIDE = 1 << 32
"""Qrels lookup key = query_index · 2^32 + doc_row: unique for rows < 2^32, queries < 2^31."""

Metric = Literal["ndcg", "recall"]
T = TypeVar("T")


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


class ReplayScorer:
    """nDCG@K or recall@K of each list against qrels (the ground-truth evaluator)."""

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
        if metric not in ("ndcg", "recall"):
            raise ValueError(f"unknown replay metric {metric!r}; valid: 'ndcg', 'recall'")
        self.k, self.metric, self.allow_unjudged, self.chunk = k, metric, allow_unjudged, chunk
        self.device = torch.device(device)
        self.qrels = qrels.to(self.device)
        self.idcg = ideal_dcg(self.qrels, k)  # (Q_judged,)
        self.n_relevant = (self.qrels.ideal > 0).sum(-1).to(torch.float64)  # (Q_judged,)
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
        dcg = ((torch.exp2(grades) - 1.0) * discounts(lists.shape[1], self.device)).sum(-1)
        return torch.where(judged, dcg / self.idcg[safe], 0.0)


def gather_docs(doc_emb: Tensor, lists: Tensor) -> tuple[Tensor, Tensor]:
    """lists (N, K) rows → embeddings (N, K, d) (padding gathers row 0) and mask (N, K) bool."""
    if lists.numel() and int(lists.max()) >= doc_emb.shape[0]:
        raise ValueError(f"document row {int(lists.max())} ≥ n_docs = {doc_emb.shape[0]}")
    mask = lists >= 0
    return doc_emb[lists.clamp(min=0)], mask


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


@dataclass(frozen=True)
class ScorerSpec:
    """Everything a scorer builder may need; built by :func:`make_scorer`."""

    qrels: QrelsTable | None
    doc_emb: Tensor | None
    k: int
    surrogate_path: Path | None
    device: torch.device
    metric: Metric
    allow_unjudged: bool
    chunk: int
    doc_fingerprint: str | None


ScorerBuilder = Callable[[ScorerSpec], SetScorer]
_REGISTRY: dict[str, ScorerBuilder] = {}


def register_scorer(name: str) -> Callable[[ScorerBuilder], ScorerBuilder]:
    """Decorator registering a builder under ``name``; a duplicate name raises."""

    def decorate(builder: ScorerBuilder) -> ScorerBuilder:
        if name in _REGISTRY:
            raise ValueError(f"scorer {name!r} is already registered")
        _REGISTRY[name] = builder
        return builder

    return decorate


def registered_scorers() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def _need(value: T | None, what: str, name: str) -> T:
    if value is None:
        raise ValueError(f"scorer {name!r} needs {what}")
    return value


@register_scorer("replay")
def _build_replay(spec: ScorerSpec) -> SetScorer:
    return ReplayScorer(
        _need(spec.qrels, "qrels", "replay"),
        k=spec.k,
        metric=spec.metric,
        allow_unjudged=spec.allow_unjudged,
        device=spec.device,
        chunk=spec.chunk,
    )


@register_scorer("cosine")
def _build_cosine(spec: ScorerSpec) -> SetScorer:
    return CosineScorer(
        _need(spec.doc_emb, "doc_emb", "cosine"),
        k=spec.k,
        device=spec.device,
        chunk=spec.chunk,
        doc_fingerprint=spec.doc_fingerprint,
    )


@register_scorer("surrogate")
def _build_surrogate(spec: ScorerSpec) -> SetScorer:
    from evaluator.surrogate import load_surrogate  # lazy: surrogate imports this module

    doc_emb = _need(spec.doc_emb, "doc_emb", "surrogate")
    return load_surrogate(
        _need(spec.surrogate_path, "surrogate_path (a fitted *.safetensors)", "surrogate"),
        doc_emb=doc_emb,
        k=spec.k,
        device=spec.device,
        chunk=spec.chunk,
        doc_fingerprint=spec.doc_fingerprint,
    )


def make_scorer(
    name: str,
    *,
    qrels: QrelsTable | Mapping[str, Mapping[int, int]] | None = None,
    doc_emb: Tensor | None = None,
    k: int,
    surrogate_path: str | Path | None = None,
    device: torch.device | str = "cpu",
    metric: Metric = "ndcg",
    allow_unjudged: bool = False,
    chunk: int = DEFAULT_CHUNK,
    doc_fingerprint: str | None = None,
) -> SetScorer:
    """Build the scorer registered under ``name`` ("replay" | "cosine" | "surrogate")."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown scorer {name!r}; valid: {', '.join(registered_scorers())}")
    table = qrels if qrels is None or isinstance(qrels, QrelsTable) else QrelsTable.from_dict(qrels)
    spec = ScorerSpec(
        qrels=table,
        doc_emb=doc_emb,
        k=k,
        surrogate_path=None if surrogate_path is None else Path(surrogate_path),
        device=torch.device(device),
        metric=metric,
        allow_unjudged=allow_unjudged,
        chunk=chunk,
        doc_fingerprint=doc_fingerprint,
    )
    return _REGISTRY[name](spec)
