"""The pooled-candidates game (``pool`` merge rule + graded recall) against a brute-force set
reference and against the coverage-game closed form φ_j = Σ_{d ∈ L_j ∖ L_0} g(d) / n_d / G, for
m = 1..8, anchor on and off, with copies of one rewrite, padding and padded actions."""

from __future__ import annotations

import itertools

import pytest
import torch

from evaluator.coalitions import PAD_DOC, coalition_lists
from evaluator.games import GAMES, check_game, coverage_shapley, game_merge, pool_mechanics
from evaluator.scorers.qrels import QrelsTable
from evaluator.scorers.replay import ReplayScorer
from evaluator.shapley import exact_shapley, leave_one_out, shapley_by_permutations, singleton

N_DOCS = 40


def _rollouts(seed: int, n_rollouts: int, m: int, k: int):  # type: ignore[no-untyped-def]
    """Action lists of distinct documents (a retriever lists a document once), some padded
    entries and padded actions, and in every other rollout a copy of action 0."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack(
        [torch.randperm(N_DOCS, generator=g)[:k] for _ in range(n_rollouts * m)]
    ).reshape(n_rollouts, m, k)
    cut = torch.rand(n_rollouts, m, 1, generator=g) < 0.2  # some lists are short
    rows = torch.where(cut & (torch.arange(k) >= k // 2), PAD_DOC, rows)
    if m > 1:
        rows[::2, 1] = rows[::2, 0]  # copies
    anchor = torch.stack([torch.randperm(N_DOCS, generator=g)[:k] for _ in range(n_rollouts)])
    n_actions = torch.randint(1, m + 1, (n_rollouts,), generator=g)
    n_actions[0] = m
    qrels = {
        f"q{r}": {d: int(torch.randint(1, 3, (1,), generator=g)) for d in range(N_DOCS) if (d * 7 + r) % 3 == 0}
        for r in range(n_rollouts)
    }  # fmt: skip
    return rows, anchor, n_actions, qrels


def _brute_values(rows, anchor, n_actions, qrels, r, anchored):  # type: ignore[no-untyped-def]
    """v(S) of rollout r for every bitmask S: graded recall of the set union."""
    m = rows.shape[1]
    grades = qrels[f"q{r}"]
    total = sum(grades.values())
    base = {int(d) for d in anchor[r] if d >= 0} if anchored else set()
    values = []
    for mask in range(2**m):
        pool = set(base)
        for j in range(int(n_actions[r])):
            if mask >> j & 1:
                pool |= {int(d) for d in rows[r, j] if d >= 0}
        values.append(sum(grades.get(d, 0) for d in pool) / total)
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("anchored", [True, False])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8])
def test_pool_game_matches_brute_force_and_the_closed_form(m: int, anchored: bool) -> None:
    k, n_rollouts = 6, 7
    rows, anchor, n_actions, qrels = _rollouts(100 + m, n_rollouts, m, k)
    kw = {"anchor_idx": anchor, "anchor_scores": torch.ones(anchor.shape)} if anchored else {}
    lists = coalition_lists(rows, torch.ones(rows.shape), n_actions, 3, merge="pool", **kw)
    assert lists.doc_idx.shape == (n_rollouts, 2**m, (m + int(anchored)) * k)  # never cut
    table = QrelsTable.from_dict(qrels)
    scorer = ReplayScorer(table, k=(m + 1) * k, metric="graded_recall")
    qids = [f"q{r}" for r in range(n_rollouts)]
    values = scorer.score(qids, torch.zeros(n_rollouts, 0), lists.doc_idx)  # (R, 2^m)
    phi = exact_shapley(values, m)
    grades = table.grades_at(
        table.indices(qids).repeat_interleave(m * k), rows.reshape(-1, 1).clamp(min=-1)
    ).reshape(rows.shape)
    total = table.ideal.sum(-1).double()[table.indices(qids)]
    closed = coverage_shapley(rows, n_actions, grades, total, anchor if anchored else None)
    for r in range(n_rollouts):
        brute = _brute_values(rows, anchor, n_actions, qrels, r, anchored)
        torch.testing.assert_close(values[r], brute, rtol=0, atol=1e-12)
        reference = shapley_by_permutations(brute[None], m)[0] if m <= 6 else phi[r]
        torch.testing.assert_close(phi[r], reference, rtol=0, atol=1e-12)
        torch.testing.assert_close(closed[r], phi[r], rtol=0, atol=1e-12)
        pool = {int(d) for d in lists.doc_idx[r, -1] if d >= 0}
        union = {int(d) for j in range(int(n_actions[r])) for d in rows[r, j] if d >= 0}
        assert pool == union | ({int(d) for d in anchor[r] if d >= 0} if anchored else set())


def test_the_pool_is_ranked_as_rrf_ranks_it() -> None:
    """Its head is the served fusion: the pool's order equals the uncut rrf list."""
    rows, anchor, n_actions, _ = _rollouts(7, 5, 4, 8)
    scores = torch.ones(rows.shape)
    kw = {"anchor_idx": anchor, "anchor_scores": torch.ones(anchor.shape)}
    pool = coalition_lists(rows, scores, n_actions, 1, merge="pool", **kw)
    rrf = coalition_lists(rows, scores, n_actions, 5 * 8, merge="rrf", **kw)
    assert torch.equal(pool.doc_idx, rrf.doc_idx)
    assert torch.equal(pool.scores, rrf.scores)


def test_copies_split_what_they_find_singleton_pays_each_leave_one_out_none() -> None:
    """Two copies of one rewrite and one other: Shapley halves the copies' documents, singleton
    pays both in full, leave-one-out pays them nothing."""
    rows = torch.tensor([[[1, 2, 3], [1, 2, 3], [4, 5, 6]]])
    anchor = torch.tensor([[3, 7, 8]])
    qrels = {"q": {1: 2, 2: 1, 3: 1, 4: 1, 9: 1}}  # G = 6; doc 3 is the anchor's
    table = QrelsTable.from_dict(qrels)
    lists = coalition_lists(
        rows, torch.ones(rows.shape), torch.tensor([3]), 1, merge="pool",
        anchor_idx=anchor, anchor_scores=torch.ones(anchor.shape),
    )  # fmt: skip
    values = ReplayScorer(table, k=12, metric="graded_recall").score(
        ["q"], torch.zeros(1, 0), lists.doc_idx
    )
    assert values[0, 0].item() == pytest.approx(1 / 6)  # the anchor alone
    torch.testing.assert_close(
        exact_shapley(values, 3)[0], torch.tensor([1.5, 1.5, 1.0], dtype=torch.float64) / 6
    )
    torch.testing.assert_close(
        singleton(values, 3)[0], torch.tensor([3.0, 3.0, 1.0], dtype=torch.float64) / 6
    )
    torch.testing.assert_close(
        leave_one_out(values, 3)[0], torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64) / 6
    )
    grades = torch.tensor([[[2, 1, 1], [2, 1, 1], [1, 0, 0]]])
    mech = pool_mechanics(rows, torch.tensor([3]), grades, anchor)
    assert mech["distinct"][0].item() == pytest.approx(6)  # 1..6
    assert mech["overlap"][0].item() == pytest.approx(3 / 6)  # 1, 2, 3 found twice
    # the gain: docs 1, 2 (both copies; g 3) and 4 (one rewrite; g 1): a quarter is unique
    assert mech["unique_gain_share"][0].item() == pytest.approx(1 / 4)


def test_games_by_name() -> None:
    assert set(GAMES) == {"list", "pool"}
    assert game_merge("pool", "rrf") == "pool" and game_merge("list", "rrf") == "rrf"
    with pytest.raises(ValueError, match="valid: list, pool"):
        check_game("bogus")
    with pytest.raises(ValueError, match="pooled game"):
        game_merge("list", "pool")
    assert list(itertools.islice(GAMES, 1)) == ["list"]  # the default game comes first
