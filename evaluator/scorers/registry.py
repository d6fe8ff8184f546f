"""Scorers extended by name (after verl's ``register_policy_loss``): read :func:`make_scorer`.

A scorer module registers a *builder* ``ScorerSpec → SetScorer`` with
``@register_scorer("name")``; :func:`make_scorer` builds one by name from the keyword
arguments every builder may need. A duplicate name raises ValueError; an unknown name raises
ValueError listing the valid ones. Adding a scorer = one new module that registers itself and
one import line in ``evaluator/scorers/__init__.py`` — no switch to edit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import torch
from torch import Tensor

from evaluator.scorers.base import DEFAULT_CHUNK, SetScorer
from evaluator.scorers.qrels import QrelsTable

__all__ = ["Metric", "ScorerSpec", "make_scorer", "need", "register_scorer", "registered_scorers"]

Metric = Literal["ndcg", "recall", "graded_recall"]
T = TypeVar("T")


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
    """Sorted names of the registered scorers."""
    return tuple(sorted(_REGISTRY))


def need(value: T | None, what: str, name: str) -> T:
    """``value``, or a ValueError saying that scorer ``name`` needs ``what``."""
    if value is None:
        raise ValueError(f"scorer {name!r} needs {what}")
    return value


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
    """Build the scorer registered under ``name`` ("replay" | "cosine" | "surrogate" | ...)."""
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
