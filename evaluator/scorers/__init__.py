"""Set-level evaluators v(query, list) behind one protocol (docs/methods.md §1, "Evaluators").

Read :func:`make_scorer` (``registry.py``) first, then :meth:`ReplayScorer.score`.

| module | scorer / part |
| --- | --- |
| ``base`` | the :class:`SetScorer` protocol and the shared batched helpers (conventions) |
| ``registry`` | ``@register_scorer(name)``, :func:`make_scorer`, :func:`registered_scorers` |
| ``qrels`` | :class:`QrelsTable` (judgments as sorted lookup keys) |
| ``replay`` | ``replay``: nDCG@K / recall@K against qrels — the ground truth |
| ``cosine`` | ``cosine``: zero-shot soft DCG of max(0, cos) gains |
| ``surrogate`` | ``surrogate``: the frozen neural set scorer (model, save/load) |
| ``surrogate_fit`` | fitting the surrogate to replay targets (not imported here) |

Importing this package registers every scorer (each module registers itself on import).
"""

from __future__ import annotations

from evaluator.scorers.base import (
    DEFAULT_CHUNK,
    PAD,
    SetScorer,
    check_lists,
    chunked,
    discounts,
    gather_docs,
    stable_hash,
    tensor_fingerprint,
)
from evaluator.scorers.cosine import CosineScorer
from evaluator.scorers.qrels import QrelsTable, ideal_dcg
from evaluator.scorers.registry import (
    Metric,
    ScorerSpec,
    make_scorer,
    register_scorer,
    registered_scorers,
)
from evaluator.scorers.replay import ReplayScorer
from evaluator.scorers.surrogate import SurrogateScorer, load_surrogate

__all__ = [
    "DEFAULT_CHUNK",
    "PAD",
    "CosineScorer",
    "Metric",
    "QrelsTable",
    "ReplayScorer",
    "ScorerSpec",
    "SetScorer",
    "SurrogateScorer",
    "check_lists",
    "chunked",
    "discounts",
    "gather_docs",
    "ideal_dcg",
    "load_surrogate",
    "make_scorer",
    "register_scorer",
    "registered_scorers",
    "stable_hash",
    "tensor_fingerprint",
]
