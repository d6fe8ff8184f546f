"""The scorers package: scorers register by name, the old import surface still works, and the
import circle between the scorers and the surrogate is gone."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor

import evaluator.scorers as scorers
from evaluator.scorers import registry
from evaluator.scorers.registry import ScorerSpec

ROOT = Path(__file__).resolve().parents[2]

# The public names of the old single-module `evaluator/scorers.py` (every caller used these).
OLD_SURFACE = (
    "DEFAULT_CHUNK PAD CosineScorer QrelsTable ReplayScorer ScorerSpec SetScorer check_lists "
    "chunked discounts make_scorer register_scorer registered_scorers stable_hash "
    "tensor_fingerprint gather_docs ideal_dcg"
).split()


class ConstantScorer:
    """v = a constant for every list (a toy scorer registered by a test)."""

    name = "constant"
    uses_query_emb = False

    def __init__(self, value: float) -> None:
        self.value = value
        self.version = scorers.stable_hash("constant", repr(value))

    def score(self, query_ids: Sequence[str], query_emb: Tensor, lists: Tensor) -> Tensor:
        return torch.full(lists.shape[:2], self.value, dtype=torch.float64)


@pytest.fixture()
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Registrations made by the test go into a copy of the registry (dropped afterwards)."""
    copy = dict(registry._REGISTRY)
    monkeypatch.setattr(registry, "_REGISTRY", copy)
    return copy  # type: ignore[return-value]


def test_old_import_surface_is_kept() -> None:
    missing = [name for name in OLD_SURFACE if not hasattr(scorers, name)]
    assert missing == []
    assert set(scorers.registered_scorers()) == {"cosine", "replay", "surrogate"}


def test_a_new_scorer_is_added_by_name_without_editing_a_switch(isolated_registry) -> None:  # type: ignore[no-untyped-def]
    @scorers.register_scorer("constant")
    def build(spec: ScorerSpec) -> scorers.SetScorer:
        return ConstantScorer(float(spec.k) / 10)

    made = scorers.make_scorer("constant", k=3)
    assert isinstance(made, scorers.SetScorer) and made.name == "constant"
    values = made.score(["q"], torch.zeros(1, 0), torch.full((1, 2, 3), -1, dtype=torch.int64))
    torch.testing.assert_close(values, torch.full((1, 2), 0.3, dtype=torch.float64))
    assert scorers.registered_scorers() == ("constant", "cosine", "replay", "surrogate")


def test_duplicate_name_raises_and_unknown_lists_valid(isolated_registry) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="scorer 'cosine' is already registered"):
        scorers.register_scorer("cosine")(lambda spec: ConstantScorer(0.0))
    with pytest.raises(
        ValueError, match=r"unknown scorer 'bm25'; valid: cosine, replay, surrogate$"
    ):
        scorers.make_scorer("bm25", k=10)
    with pytest.raises(ValueError, match="scorer 'cosine' needs doc_emb"):
        scorers.make_scorer("cosine", k=10)


@pytest.mark.parametrize(
    "module", ["evaluator.scorers.surrogate", "evaluator.scorers.surrogate_fit", "evaluator.credit"]
)
def test_no_import_circle_whatever_is_imported_first(module: str) -> None:
    """A fresh interpreter importing one module first gets every scorer registered."""
    code = f"import {module}; from evaluator.scorers import registered_scorers as r; print(r())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('cosine', 'replay', 'surrogate')"
