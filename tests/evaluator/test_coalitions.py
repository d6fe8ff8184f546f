"""Coalition lists: the vectorized merge equals a slow dict-merge reference."""

from __future__ import annotations

import pytest
import torch

from evaluator.coalitions import (
    PAD_DOC,
    PAD_SCORE,
    coalition_lists,
    coalition_masks,
    coalition_sizes,
)


def reference_list(
    doc_idx: torch.Tensor, scores: torch.Tensor, n_actions: int, coalition: int, top_k: int
) -> list[tuple[int, float]]:
    """One rollout, one coalition: dict merge with max, sort by (−score, doc), truncate."""
    best: dict[int, float] = {}
    for j in range(min(n_actions, doc_idx.shape[0])):
        if not coalition >> j & 1:
            continue
        for doc, score in zip(doc_idx[j].tolist(), scores[j].tolist(), strict=True):
            if doc >= 0:
                best[doc] = max(best.get(doc, -float("inf")), score)
    return sorted(best.items(), key=lambda item: (-item[1], item[0]))[:top_k]


def random_inputs(
    seed: int, n_rollouts: int, n_slots: int, k: int, n_docs: int, n_levels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Few documents (duplicates across actions), few score levels (ties), empty actions,
    random −1 padding, variable n_actions including 0."""
    g = torch.Generator().manual_seed(seed)
    doc_idx = torch.randint(0, n_docs, (n_rollouts, n_slots, k), generator=g)
    scores = torch.randint(0, n_levels, (n_rollouts, n_slots, k), generator=g).float() / 4 - 1
    doc_idx[torch.rand(doc_idx.shape, generator=g) < 0.2] = PAD_DOC
    doc_idx[torch.rand(n_rollouts, n_slots, generator=g) < 0.15] = PAD_DOC  # empty actions
    n_actions = torch.randint(0, n_slots + 1, (n_rollouts,), generator=g)
    return doc_idx, scores, n_actions


def assert_matches_reference(
    doc_idx: torch.Tensor, scores: torch.Tensor, n_actions: torch.Tensor, top_k: int
) -> None:
    out = coalition_lists(doc_idx, scores, n_actions, top_k, chunk_size=3)
    n_rollouts, n_slots, _ = doc_idx.shape
    assert out.doc_idx.shape == (n_rollouts, 2**n_slots, top_k)
    assert out.doc_idx.dtype == torch.int64 and out.scores.dtype == torch.float32
    for r in range(n_rollouts):
        for s in range(2**n_slots):
            ref = reference_list(doc_idx[r], scores[r], int(n_actions[r]), s, top_k)
            got_docs = out.doc_idx[r, s].tolist()
            got_scores = out.scores[r, s].tolist()
            pad = top_k - len(ref)
            assert got_docs == [d for d, _ in ref] + [PAD_DOC] * pad, (r, s)
            assert got_scores == [x for _, x in ref] + [PAD_SCORE] * pad, (r, s)


@pytest.mark.parametrize(
    ("seed", "n_slots", "k", "n_docs", "top_k"),
    [
        (0, 3, 4, 8, 5),  # K smaller than most unions
        (1, 4, 5, 12, 30),  # K larger than any union (output padded)
        (2, 5, 3, 6, 2),  # heavy duplication, tiny K
        (3, 2, 6, 100, 7),  # few duplicates
        (4, 1, 4, 5, 4),  # a single action
    ],
)
def test_equals_reference(seed: int, n_slots: int, k: int, n_docs: int, top_k: int) -> None:
    doc_idx, scores, n_actions = random_inputs(seed, 7, n_slots, k, n_docs, n_levels=4)
    assert_matches_reference(doc_idx, scores, n_actions, top_k)


def test_equals_reference_continuous_scores() -> None:
    g = torch.Generator().manual_seed(5)
    doc_idx, _, n_actions = random_inputs(5, 5, 4, 6, 15, n_levels=4)
    scores = torch.randn(doc_idx.shape, generator=g)
    assert_matches_reference(doc_idx, scores, n_actions, 8)


def test_duplicate_document_keeps_best_score_and_ties_prefer_smaller_doc() -> None:
    doc_idx = torch.tensor([[[7, 3, 5], [3, 9, -1]]])
    scores = torch.tensor([[[0.5, 0.1, 0.5], [0.9, 0.5, 0.0]]])
    out = coalition_lists(doc_idx, scores, torch.tensor([2]), top_k=5)
    assert out.doc_idx[0, 3].tolist() == [3, 5, 7, 9, -1]
    torch.testing.assert_close(out.scores[0, 3], torch.tensor([0.9, 0.5, 0.5, 0.5, 0.0]))
    assert out.doc_idx[0, 1].tolist() == [5, 7, 3, -1, -1]


def test_empty_and_full_coalitions() -> None:
    doc_idx, scores, _ = random_inputs(6, 4, 3, 5, 10, n_levels=3)
    n_actions = torch.full((4,), 3)
    out = coalition_lists(doc_idx, scores, n_actions, top_k=6)
    assert (out.doc_idx[:, 0] == PAD_DOC).all() and (out.scores[:, 0] == PAD_SCORE).all()
    assert not out.valid[:, 0].any()
    for r in range(4):
        ref = reference_list(doc_idx[r], scores[r], 3, 0b111, 6)
        assert out.doc_idx[r, -1, : len(ref)].tolist() == [d for d, _ in ref]


def test_padded_actions_are_null_players() -> None:
    n_slots = 4
    doc_idx, scores, _ = random_inputs(7, 6, n_slots, 5, 12, n_levels=5)
    n_actions = torch.tensor([0, 1, 2, 3, 4, 2])
    out = coalition_lists(doc_idx, scores, n_actions, top_k=8)
    for r, n in enumerate(n_actions.tolist()):
        for s in range(2**n_slots):
            for j in range(n, n_slots):
                assert torch.equal(out.doc_idx[r, s], out.doc_idx[r, s | 1 << j])
                assert torch.equal(out.scores[r, s], out.scores[r, s | 1 << j])


def test_chunking_does_not_change_result() -> None:
    doc_idx, scores, n_actions = random_inputs(8, 9, 5, 4, 20, n_levels=3)
    whole = coalition_lists(doc_idx, scores, n_actions, top_k=6)
    for chunk_size in (1, 2, 4, 100):
        part = coalition_lists(doc_idx, scores, n_actions, top_k=6, chunk_size=chunk_size)
        assert torch.equal(whole.doc_idx, part.doc_idx)
        assert torch.equal(whole.scores, part.scores)


def test_large_batch_shapes() -> None:
    g = torch.Generator().manual_seed(9)
    doc_idx = torch.randint(0, 1000, (64, 10, 10), generator=g)
    scores = torch.rand(64, 10, 10, generator=g)
    out = coalition_lists(doc_idx, scores, torch.full((64,), 10), top_k=10)
    assert out.doc_idx.shape == (64, 1024, 10)
    assert (out.scores[:, :, :-1] >= out.scores[:, :, 1:]).all()  # descending
    # a singleton coalition is exactly that action's deduplicated list, re-sorted
    ref = reference_list(doc_idx[3], scores[3], 10, 1 << 6, 10)
    assert out.doc_idx[3, 1 << 6].tolist() == [d for d, _ in ref]


def test_masks_and_sizes() -> None:
    masks = coalition_masks(3)
    assert masks.shape == (8, 3) and masks.dtype == torch.bool
    assert masks[0b101].tolist() == [True, False, True]
    torch.testing.assert_close(coalition_sizes(3), masks.sum(1))
    torch.testing.assert_close(coalition_sizes(12), coalition_masks(12).sum(1))


@pytest.mark.parametrize(
    ("shape", "n_actions", "match"),
    [
        ((2, 13, 3), torch.zeros(2, dtype=torch.int64), "M"),
        ((2, 3, 3), torch.zeros(3, dtype=torch.int64), "n_actions"),
    ],
)
def test_bad_inputs_raise(shape: tuple[int, int, int], n_actions: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        coalition_lists(torch.zeros(shape, dtype=torch.int64), torch.zeros(shape), n_actions, 4)


def test_non_finite_score_raises() -> None:
    scores = torch.tensor([[[float("nan"), 0.0]]])
    with pytest.raises(ValueError, match="finite"):
        coalition_lists(torch.tensor([[[1, 2]]]), scores, torch.tensor([1]), 2)


def test_many_ties_at_large_m_equal_reference() -> None:
    # long rows (V = 100) full of ties: the stable sort must still put smaller doc ids first
    doc_idx, scores, _ = random_inputs(10, 3, 10, 10, 40, n_levels=3)
    n_actions = torch.tensor([10, 7, 4])
    out = coalition_lists(doc_idx, scores, n_actions, top_k=12)
    g = torch.Generator().manual_seed(11)
    for r in range(3):
        for s in torch.randint(0, 2**10, (60,), generator=g).tolist() + [2**10 - 1]:
            ref = reference_list(doc_idx[r], scores[r], int(n_actions[r]), s, 12)
            pad = 12 - len(ref)
            assert out.doc_idx[r, s].tolist() == [d for d, _ in ref] + [PAD_DOC] * pad
            assert out.scores[r, s].tolist() == [x for _, x in ref] + [PAD_SCORE] * pad
