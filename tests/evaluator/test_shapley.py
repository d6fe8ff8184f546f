"""Exact Shapley: axioms, closed forms, the permutation reference, shapiq, and the m ≥ 4 fact."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from evaluator.shapley import (
    MAX_PLAYERS,
    broadcast,
    coalition_masks,
    coalition_sizes,
    efficiency_residual,
    exact_shapley,
    leave_one_out,
    shapley_by_permutations,
    shapley_interaction,
    shapley_weight_matrix,
    singleton,
)

EFFICIENCY_TOL = 1e-9  # docs/methods.md §1: Σφ = v(N) − v(∅) to 1e-9 in float64


def random_games(seed: int, n_games: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_games, 2**n, generator=g, dtype=torch.float64)


def game_from(n: int, rule: Callable[[frozenset[int]], float]) -> torch.Tensor:
    """Value table (2**n,) of a game given as a function of the coalition (a set of players)."""
    return torch.tensor(
        [rule(frozenset(j for j in range(n) if s >> j & 1)) for s in range(2**n)],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("n", range(1, MAX_PLAYERS + 1))
def test_efficiency(n: int) -> None:
    values = random_games(n, 16, n) * 10
    phi = exact_shapley(values, n)
    assert phi.shape == (16, n) and phi.dtype == torch.float64
    assert efficiency_residual(values, phi).abs().max() <= EFFICIENCY_TOL


@pytest.mark.parametrize("n", range(1, 7))
def test_batched_equals_per_game_equals_permutations(n: int) -> None:
    values = random_games(100 + n, 5, n).reshape(5, 1, 2**n)  # extra batch dim
    batched = exact_shapley(values, n)
    per_game = torch.stack([exact_shapley(v[0], n) for v in values])[:, None]
    torch.testing.assert_close(batched, per_game, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(batched, shapley_by_permutations(values, n), rtol=0, atol=1e-12)


def test_float32_input_is_promoted() -> None:
    values = random_games(7, 3, 4)
    phi = exact_shapley(values.float(), 4)
    assert phi.dtype == torch.float64
    torch.testing.assert_close(phi, exact_shapley(values.float().double(), 4), rtol=0, atol=0)


def test_symmetry() -> None:
    # v depends on S only through |S ∩ {0, 1}| and 2 ∈ S: players 0 and 1 are interchangeable
    n = 4
    g = torch.Generator().manual_seed(3)
    table = torch.randn(3, 2, generator=g, dtype=torch.float64)
    values = game_from(n, lambda s: float(table[len(s & {0, 1}), int(2 in s)]))
    phi = exact_shapley(values, n)
    torch.testing.assert_close(phi[0], phi[1], rtol=0, atol=1e-14)


def test_null_player() -> None:
    n = 5
    values = random_games(4, 8, n)
    without_3 = torch.arange(2**n) & ~(1 << 3)  # player 3 never changes the value
    values = values[:, without_3]
    phi = exact_shapley(values, n)
    torch.testing.assert_close(phi[:, 3], torch.zeros(8, dtype=torch.float64), rtol=0, atol=1e-14)


def test_linearity() -> None:
    n = 6
    u, w = random_games(5, 4, n), random_games(6, 4, n)
    lhs = exact_shapley(2.5 * u - 0.75 * w, n)
    rhs = 2.5 * exact_shapley(u, n) - 0.75 * exact_shapley(w, n)
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)


def test_additive_game_gives_weights_and_baselines_agree() -> None:
    n = 5
    weights = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7], dtype=torch.float64)
    values = coalition_masks(n).double() @ weights + 4.0  # v(∅) = 4
    phi = exact_shapley(values, n)
    torch.testing.assert_close(phi, weights, rtol=0, atol=1e-14)
    torch.testing.assert_close(singleton(values, n), weights, rtol=0, atol=1e-14)
    torch.testing.assert_close(leave_one_out(values, n), weights, rtol=0, atol=1e-14)
    torch.testing.assert_close(shapley_interaction(values, n), torch.zeros(n, n).double())


@pytest.mark.parametrize(("n", "carrier"), [(3, {0, 2}), (5, {1, 2, 4}), (8, {0, 1, 2, 3, 7})])
def test_unanimity_game(n: int, carrier: set[int]) -> None:
    values = game_from(n, lambda s: float(carrier <= s))
    share = [1 / len(carrier) if j in carrier else 0.0 for j in range(n)]
    expected = torch.tensor(share, dtype=torch.float64)
    torch.testing.assert_close(exact_shapley(values, n), expected, rtol=0, atol=1e-14)


def test_glove_game() -> None:
    # player 0 holds a left glove, players 1 and 2 right gloves; a pair is worth 1
    values = game_from(3, lambda s: float(0 in s and bool(s & {1, 2})))
    expected = torch.tensor([2 / 3, 1 / 6, 1 / 6], dtype=torch.float64)
    torch.testing.assert_close(exact_shapley(values, 3), expected, rtol=0, atol=1e-15)


def test_baselines_closed_form() -> None:
    n = 3
    values = torch.arange(8, dtype=torch.float64) ** 2  # v(S) = S²
    torch.testing.assert_close(broadcast(values, n), torch.full((3,), 49.0).double())
    torch.testing.assert_close(singleton(values, n), torch.tensor([1.0, 4.0, 16.0]).double())
    torch.testing.assert_close(leave_one_out(values, n), torch.tensor([13.0, 24.0, 40.0]).double())
    batch = random_games(8, 6, n).reshape(2, 3, 8)
    assert broadcast(batch, n).shape == singleton(batch, n).shape == (2, 3, 3)
    assert leave_one_out(batch, n).shape == (2, 3, 3)


@pytest.mark.parametrize("n", [2, 5, 8])
def test_agrees_with_shapiq(n: int) -> None:
    import shapiq  # dev dependency, imported here so the rest of the file runs without it

    players = 1 << np.arange(n)
    for values in random_games(200 + n, 3, n).numpy():

        def game(coalitions: np.ndarray, table: np.ndarray = values) -> np.ndarray:
            return table[coalitions.astype(np.int64) @ players]

        computer = shapiq.ExactComputer(game, n_players=n)
        sv, sii = computer("SV"), computer("SII", order=2)
        ours = exact_shapley(torch.from_numpy(values), n).numpy()
        inter = shapley_interaction(torch.from_numpy(values), n).numpy()
        assert_allclose(ours, [sv[(j,)] for j in range(n)], rtol=1e-10, atol=1e-12)
        pairs = list(itertools.combinations(range(n), 2))
        assert_allclose(
            [inter[j, k] for j, k in pairs], [sii[p] for p in pairs], rtol=1e-10, atol=1e-12
        )


# ---- interaction index --------------------------------------------------------------------


def test_interaction_symmetric_zero_diagonal() -> None:
    n = 6
    inter = shapley_interaction(random_games(9, 4, n), n)
    assert inter.shape == (4, n, n)
    torch.testing.assert_close(inter, inter.transpose(-1, -2), rtol=0, atol=0)
    torch.testing.assert_close(torch.diagonal(inter, dim1=-2, dim2=-1), torch.zeros(4, n).double())


def test_interaction_complementary_and_redundant() -> None:
    n = 4
    both = game_from(n, lambda s: float({0, 1} <= s))  # only the pair does the job
    either = game_from(n, lambda s: float(bool(s & {0, 1})))  # either one does the job
    assert shapley_interaction(both, n)[0, 1] == pytest.approx(1.0, abs=1e-14)
    assert shapley_interaction(either, n)[0, 1] == pytest.approx(-1.0, abs=1e-14)
    assert shapley_interaction(either, n)[0, 2] == pytest.approx(0.0, abs=1e-14)


def test_interaction_single_player_is_zero() -> None:
    torch.testing.assert_close(
        shapley_interaction(torch.tensor([0.0, 1.0]), 1), torch.zeros(1, 1).double()
    )


# ---- the m ≥ 4 fact: ∅, singletons, leave-one-outs and N determine φ only for m ≤ 3 ----------


def observed_coalitions(n: int) -> list[int]:
    full = 2**n - 1
    return sorted({0, full} | {1 << j for j in range(n)} | {full ^ (1 << j) for j in range(n)})


@pytest.mark.parametrize(
    ("n", "determined"), [(1, True), (2, True), (3, True), (4, False), (5, False)]
)
def test_observed_coalitions_determine_phi_only_up_to_three(n: int, determined: bool) -> None:
    # φ_j = <W[:, j], v>: determined by the observed entries iff every row of Wᵀ lies in the
    # span of the indicator vectors of the observed coalitions
    basis = torch.eye(2**n, dtype=torch.float64)[observed_coalitions(n)]
    stacked = torch.cat([basis, shapley_weight_matrix(n).T])
    same_rank = torch.linalg.matrix_rank(stacked) == torch.linalg.matrix_rank(basis)
    assert bool(same_rank) is determined


def test_two_games_equal_on_observed_coalitions_with_different_phi() -> None:
    n = 4
    base = game_from(n, lambda s: float(len(s)) ** 2)
    bump = game_from(n, lambda s: float(s == {0, 1}))  # lives on a 2-coalition: unobserved
    assert torch.equal(base[observed_coalitions(n)], (base + bump)[observed_coalitions(n)])
    delta = exact_shapley(base + bump, n) - exact_shapley(base, n)
    expected = torch.tensor([1, 1, -1, -1], dtype=torch.float64) / 12
    torch.testing.assert_close(delta, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize(("n", "largest"), [(4, 1 / 12), (5, 1 / 20)])
def test_largest_weight_on_unseen_coalition(n: int, largest: float) -> None:
    unseen = torch.ones(2**n, dtype=torch.bool)
    unseen[observed_coalitions(n)] = False
    assert unseen.any()
    weight = shapley_weight_matrix(n)[unseen].abs().max().item()
    assert weight == pytest.approx(largest, rel=1e-14)


# ---- errors and helpers -------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, MAX_PLAYERS + 1])
def test_bad_player_count_raises(n: int) -> None:
    with pytest.raises(ValueError, match="n_players must be in"):
        exact_shapley(torch.zeros(2**n), n)


def test_wrong_last_dim_raises() -> None:
    with pytest.raises(ValueError, match="last dimension"):
        exact_shapley(torch.zeros(4, 15), 4)


def test_weight_matrix_rows_sum_closed_form() -> None:
    # φ of the constant game is 0 (null players), so every column of W sums to 0
    for n in range(1, MAX_PLAYERS + 1):
        w = shapley_weight_matrix(n)
        assert w.shape == (2**n, n)
        assert w.sum(0).abs().max() <= 1e-14
    assert coalition_sizes(4).tolist() == [bin(s).count("1") for s in range(16)]
