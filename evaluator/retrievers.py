"""Retrieval backends behind one protocol, registered by name in ONE place.

Read first: :class:`Retriever` (what the action executor needs), then :func:`build_retriever`.

Registered here (and only here):

- ``dense``: MiniLM embeddings + exact inner-product FAISS (:mod:`evaluator.index`); scores are
  cosine similarities, comparable across queries, so its default merge rule is ``max``; equal
  scores rank the smaller row first (as ``bm25``'s do);
- ``bm25``: lexical BM25 through ``bm25s`` (:mod:`evaluator.bm25`); BM25 scores of different
  queries are not comparable, so its default merge rule is ``rrf`` (reciprocal-rank fusion).

Both write a versioned folder ``<var>/index/<version>/`` under the same manifest / damage /
rebuild rules. Adding a backend = one builder decorated with :func:`register_retriever` in this
module; a duplicate name raises ValueError, an unknown name raises ValueError listing the valid
ones. Heavy modules (FAISS, torch, bm25s) are imported inside the builders, so importing this
module (e.g. to validate a setting) is cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from evaluator.corpus import Document
    from evaluator.embed import Embedder
    from evaluator.index import DocIndex

__all__ = [
    "DEFAULT_RRF_K",
    "MERGE_RULES",
    "DenseRetriever",
    "Retriever",
    "RetrieverSpec",
    "build_retriever",
    "check_merge",
    "check_retriever",
    "default_merge",
    "register_retriever",
    "registered_retrievers",
]

MERGE_RULES = ("max", "rrf", "pool")
"""How a coalition's lists are merged (:func:`evaluator.coalitions.coalition_lists`): ``max``
and ``rrf`` cut the merged list to K; ``pool`` keeps every document of every list (ranked as
``rrf`` ranks them), the candidate pool of the pooled game (:mod:`evaluator.games`)."""

DEFAULT_RRF_K = 60.0
"""The reciprocal-rank fusion constant of Cormack et al. (2009)."""

ProgressFactory = Callable[[int], AbstractContextManager[Callable[[int], None] | None]]


class Retriever(Protocol):
    """What executing an action needs: texts in, top-k rows and scores out.

    ``version`` names the index (retriever, parameters, corpus) and ``encoder_version`` the
    query side (the embedder, or BM25's tokenizer + scoring); the action cache keys carry both.
    """

    @property
    def name(self) -> str: ...

    @property
    def doc_ids(self) -> list[str]: ...

    @property
    def version(self) -> str: ...

    @property
    def encoder_version(self) -> str: ...

    def __len__(self) -> int: ...

    def retrieve(self, texts: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows (n, k) int64, −1 padded; scores (n, k) float32, descending, −inf padded)."""
        ...


@dataclass
class DenseRetriever:
    """The embedder + a FAISS :class:`~evaluator.index.DocIndex` as one :class:`Retriever`."""

    embedder: Embedder
    index: DocIndex
    name: str = "dense"

    @property
    def version(self) -> str:
        return self.index.version

    @property
    def encoder_version(self) -> str:
        return self.embedder.version

    @property
    def doc_ids(self) -> list[str]:
        return self.index.doc_ids

    def __len__(self) -> int:
        return len(self.index)

    def retrieve(self, texts: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        if not texts:
            return np.full((0, k), -1, np.int64), np.full((0, k), -np.inf, np.float32)
        rows, scores = self.index.search(self.embedder.encode(list(texts)), k)
        scores[rows < 0] = -np.inf  # FAISS pads short results with −1 rows
        # FAISS returns tied scores larger row first: rank them as bm25 does (score descending,
        # ties: smaller row first); the −1 padding (score −∞) stays last
        order = np.lexsort((rows, -scores), axis=1)
        return np.take_along_axis(rows, order, 1), np.take_along_axis(scores, order, 1)


@dataclass(frozen=True)
class RetrieverSpec:
    """Everything a builder may need. ``params``: backend parameters (bm25: ``k1``, ``b``)."""

    documents: Sequence[Document]
    var_dir: Path
    embedder: Embedder | None = None
    progress_factory: ProgressFactory | None = None
    use_gpu: bool = False
    params: dict[str, Any] | None = None


RetrieverBuilder = Callable[[RetrieverSpec], tuple[Retriever, bool]]


@dataclass(frozen=True)
class _Entry:
    builder: RetrieverBuilder
    default_merge: str


_REGISTRY: dict[str, _Entry] = {}


def register_retriever(
    name: str, *, default_merge: str
) -> Callable[[RetrieverBuilder], RetrieverBuilder]:
    """Decorator registering ``builder(spec) → (retriever, built_now)`` under ``name``."""
    check_merge(default_merge)

    def decorate(builder: RetrieverBuilder) -> RetrieverBuilder:
        if name in _REGISTRY:
            raise ValueError(f"retriever {name!r} is already registered")
        _REGISTRY[name] = _Entry(builder, default_merge)
        return builder

    return decorate


def registered_retrievers() -> tuple[str, ...]:
    """Sorted names of the registered retrievers."""
    return tuple(sorted(_REGISTRY))


def check_retriever(name: str) -> str:
    """``name`` if registered, else ValueError listing the valid names."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown retriever {name!r}; valid: {', '.join(registered_retrievers())}")
    return name


def check_merge(merge: str) -> str:
    """``merge`` if it is a merge rule, else ValueError listing them."""
    if merge not in MERGE_RULES:
        raise ValueError(f"unknown merge rule {merge!r}; valid: {', '.join(MERGE_RULES)}")
    return merge


def default_merge(name: str) -> str:
    """The merge rule a retriever's lists get unless one is asked for."""
    return _REGISTRY[check_retriever(name)].default_merge


def build_retriever(name: str, spec: RetrieverSpec) -> tuple[Retriever, bool]:
    """Build (or load, when its version is saved and sound) the retriever ``name``."""
    return _REGISTRY[check_retriever(name)].builder(spec)


@register_retriever("dense", default_merge="max")
def _build_dense(spec: RetrieverSpec) -> tuple[Retriever, bool]:
    from evaluator.index import build_or_load

    if spec.embedder is None:
        raise ValueError("retriever 'dense' needs an embedder")
    index, built = build_or_load(
        spec.documents, spec.embedder, spec.var_dir, spec.progress_factory, use_gpu=spec.use_gpu
    )
    return DenseRetriever(spec.embedder, index), built


@register_retriever("bm25", default_merge="rrf")
def _build_bm25(spec: RetrieverSpec) -> tuple[Retriever, bool]:
    from evaluator.bm25 import BM25Params, build_or_load_bm25

    params = BM25Params(**(spec.params or {}))
    return build_or_load_bm25(spec.documents, spec.var_dir, params)
