"""The ``rrf`` merge rule (and ``max`` with the anchor) against a brute-force per-coalition
reference, for m = 1..8, anchor on and off, with duplicates, padding and exact ties."""

from __future__ import annotations

import pytest
import torch

from evaluator.coalitions import PAD_DOC, PAD_SCORE, coalition_lists


def _contributions(docs: list[int], scores: list[float], merge: str, rrf_k: float) -> dict:
    """One list's contribution per document: best score (max) or 1/(k + rank) at its first
    occurrence (rrf; rank = 1-based position among the list's real entries)."""
    out: dict[int, float] = {}
    rank = 0
    for doc, score in zip(docs, scores, strict=True):
        if doc < 0:
            continue
        rank += 1
        value = score if merge == "max" else 1.0 / (rrf_k + rank)
        out[doc] = max(out.get(doc, -float("inf")), value)
    return out


def reference_list(
    doc_idx: torch.Tensor,
    scores: torch.Tensor,
    n_actions: int,
    coalition: int,
    top_k: int,
    merge: str,
    rrf_k: float,
    anchor: tuple[list[int], list[float]] | None,
) -> list[tuple[int, float]]:
    """Dict merge of the anchor then the coalition's actions in ascending j (the order the
    engine accumulates rrf sums in), sorted by (−score, doc), truncated to K."""
    lists = [] if anchor is None else [_contributions(*anchor, merge, rrf_k)]
    for j in range(n_actions):
        if coalition >> j & 1:
            lists.append(_contributions(doc_idx[j].tolist(), scores[j].tolist(), merge, rrf_k))
    merged: dict[int, float] = {}
    for contrib in lists:
        for doc, value in contrib.items():
            if merge == "max":
                merged[doc] = max(merged.get(doc, -float("inf")), value)
            else:
                merged[doc] = merged.get(doc, 0.0) + value
    return sorted(merged.items(), key=lambda item: (-item[1], item[0]))[:top_k]


def _inputs(seed: int, n_rollouts: int, m: int, k: int, n_docs: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    doc_idx = torch.randint(0, n_docs, (n_rollouts, m, k), generator=g)
    doc_idx[torch.rand(doc_idx.shape, generator=g) < 0.15] = PAD_DOC
    scores = torch.randint(0, 4, doc_idx.shape, generator=g).float() / 4  # many score ties
    n_actions = torch.randint(0, m + 1, (n_rollouts,), generator=g)
    n_actions[0] = m  # at least one full rollout
    anchor_idx = torch.randint(0, n_docs, (n_rollouts, k), generator=g)
    anchor_idx[:, -1] = PAD_DOC
    anchor_scores = torch.rand((n_rollouts, k), generator=g)
    return doc_idx, scores, n_actions, anchor_idx, anchor_scores


def _check(seed: int, m: int, merge: str, anchored: bool, rrf_k: float = 60.0) -> None:
    k, top_k, n_docs = 4, 6, 3 * m + 3  # few documents: many found by several actions
    doc_idx, scores, n_actions, a_idx, a_scores = _inputs(seed, 3, m, k, n_docs)
    anchor_kw = {"anchor_idx": a_idx, "anchor_scores": a_scores} if anchored else {}
    out = coalition_lists(
        doc_idx, scores, n_actions, top_k, merge=merge, rrf_k=rrf_k, chunk_size=2, **anchor_kw
    )
    assert out.doc_idx.shape == (3, 2**m, top_k) and out.scores.dtype == torch.float32
    for r in range(3):
        anchor = (a_idx[r].tolist(), a_scores[r].tolist()) if anchored else None
        for s in range(2**m):
            ref = reference_list(
                doc_idx[r], scores[r], int(n_actions[r]), s, top_k, merge, rrf_k, anchor
            )
            pad = top_k - len(ref)
            assert out.doc_idx[r, s].tolist() == [d for d, _ in ref] + [PAD_DOC] * pad, (r, s)
            want = torch.tensor([x for _, x in ref] + [PAD_SCORE] * pad, dtype=torch.float32)
            assert torch.equal(out.scores[r, s], want), (r, s)


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("anchored", [False, True])
def test_rrf_equals_brute_force(m: int, anchored: bool) -> None:
    _check(seed=10 + m, m=m, merge="rrf", anchored=anchored)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("anchored", [False, True])
def test_max_equals_brute_force_with_anchor(m: int, anchored: bool) -> None:
    _check(seed=30 + m, m=m, merge="max", anchored=anchored)


@pytest.mark.parametrize("rrf_k", [0.0, 1.0, 1000.0])
def test_rrf_k_is_configurable(rrf_k: float) -> None:
    _check(seed=7, m=4, merge="rrf", anchored=True, rrf_k=rrf_k)


def test_rrf_ties_rank_the_smaller_document_first_like_max() -> None:
    """Documents 9 and 2 are both first in one list each: equal fused scores; 2 wins, as it
    wins an equal-score tie under max."""
    doc_idx = torch.tensor([[[9, 5], [2, 6]]])
    scores = torch.tensor([[[0.5, 0.1], [0.5, 0.2]]])
    for merge in ("max", "rrf"):
        out = coalition_lists(doc_idx, scores, torch.tensor([2]), 4, merge=merge)
        assert out.doc_idx[0, 3, :2].tolist() == [2, 9], merge


def test_rrf_rewards_agreement_max_does_not() -> None:
    """Under rrf a document found by both actions outranks each action's own top document."""
    doc_idx = torch.tensor([[[1, 3], [2, 3]]])  # doc 3 is second in both lists
    scores = torch.tensor([[[0.9, 0.5], [0.8, 0.4]]])
    n = torch.tensor([2])
    assert coalition_lists(doc_idx, scores, n, 3, merge="max").doc_idx[0, 3].tolist() == [1, 2, 3]
    assert coalition_lists(doc_idx, scores, n, 3, merge="rrf").doc_idx[0, 3].tolist() == [3, 1, 2]


def test_rrf_empty_coalition_is_the_anchor_alone_in_its_order() -> None:
    doc_idx = torch.tensor([[[4, 5]]])
    a_idx, a_scores = torch.tensor([[7, 1, PAD_DOC]]), torch.tensor([[0.3, 0.9, 0.0]])
    doc_idx = torch.cat([doc_idx, torch.full((1, 1, 1), PAD_DOC)], 2)
    out = coalition_lists(
        doc_idx, torch.zeros(1, 1, 3), torch.tensor([1]), 3,
        anchor_idx=a_idx, anchor_scores=a_scores, merge="rrf",
    )  # fmt: skip
    assert out.doc_idx[0, 0].tolist() == [7, 1, PAD_DOC]  # rank order, not score order
    assert out.scores[0, 0, 0].item() == pytest.approx(1 / 61)


def test_bad_merge_arguments_raise() -> None:
    args = (torch.zeros(1, 1, 2, dtype=torch.int64), torch.zeros(1, 1, 2), torch.tensor([1]), 2)
    with pytest.raises(ValueError, match="unknown merge rule 'sum'; valid: max, rrf"):
        coalition_lists(*args, merge="sum")
    with pytest.raises(ValueError, match="rrf_k must be >= 0"):
        coalition_lists(*args, merge="rrf", rrf_k=-1.0)
