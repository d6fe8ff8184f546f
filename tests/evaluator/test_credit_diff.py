"""credit_differences: closed-form games, hand-built tables where the two readings of "v
changes" and of "orders differently" part, and a slow per-rollout reference on random games."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from evaluator.credit_diff import RANK_KEYS, credit_differences
from evaluator.shapley import shapley_by_permutations


def _table(m: int, v) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """(2^m,) table of v(set of players)."""
    return torch.tensor(
        [v({j for j in range(m) if s >> j & 1}) for s in range(2**m)], dtype=torch.float64
    )


def test_additive_game_all_credits_agree() -> None:
    w = [0.3, 0.1, 0.2]
    res = credit_differences(
        _table(3, lambda s: 0.5 + sum(w[j] for j in s))[None], torch.tensor([3])
    )
    assert res.v_any_changes == 1.0 and res.v_full_changes == 1.0
    assert res.n_ranked == 1 and res.n_gain == 1
    assert all(getattr(res, key) == 0.0 for key in RANK_KEYS)
    assert res.singleton_gap == pytest.approx(0.0, abs=1e-12)
    assert res.interaction_mean == pytest.approx(0.0, abs=1e-12)


def test_redundant_pair_closed_form() -> None:
    """v = 1 if any action: φ = ½ each, singleton 1, leave-one-out 0, I = −1."""
    res = credit_differences(_table(2, lambda s: float(bool(s)))[None], torch.tensor([2]))
    assert all(getattr(res, key) == 0.0 for key in RANK_KEYS)  # both tie under every credit
    assert res.singleton_gap == pytest.approx(0.5) and res.leave_one_out_gap == pytest.approx(0.5)
    assert res.interaction_mean == pytest.approx(-1.0)
    assert res.interaction_abs_mean == pytest.approx(1.0)


def test_complementarity_reorders_singleton() -> None:
    """Action 0 alone is best, but 1 and 2 together complete the set: φ ranks 0 last."""
    values = {frozenset(): 0.0, frozenset({0}): 0.4, frozenset({1}): 0.1, frozenset({2}): 0.1}
    table = _table(3, lambda s: values.get(frozenset(s), 1.0 if {1, 2} <= s else 0.4))
    res = credit_differences(table[None], torch.tensor([3]))
    assert res.singleton_rank_differs_tie_aware == 1.0
    assert res.singleton_rank_reversed_strict == 1.0  # a strict reversal, not only a tie


def test_unchanged_rollouts_and_padding() -> None:
    flat = torch.full((1, 8), 0.7, dtype=torch.float64)  # the rewrites change nothing
    one = _table(3, lambda s: 0.2 + 0.3 * (0 in s))[None]  # m = 1 padded to 3: null players
    res = credit_differences(torch.cat([flat, one]), torch.tensor([3, 1]))
    assert res.v_any_changes == 0.5 and res.v_full_changes == 0.5
    assert res.n_gain == 1 and res.n_ranked == 1
    assert res.singleton_rank_differs_tie_aware == 0.0 and res.singleton_gap == pytest.approx(0.0)
    with pytest.raises(ValueError, match="2\\^M columns"):
        credit_differences(torch.zeros(1, 6), torch.tensor([2]))


def _sets(m: int, values: dict[frozenset[int], float]):  # type: ignore[no-untyped-def]
    return _table(m, lambda s: values[frozenset(s)])


def test_v_changes_two_readings_part_on_cancelling_rewrites() -> None:
    """Bug (review): "v changes" counted any v(S) ≠ v(∅). A rollout whose rewrites move single
    coalitions but cancel in v(N) changes v under that reading, not under v(N) ≠ v(∅)."""
    flat = torch.full((4,), 0.5, dtype=torch.float64)
    cancel = _sets(2, {frozenset(): 0.5, frozenset({0}): 0.7, frozenset({1}): 0.3,
                       frozenset({0, 1}): 0.5})  # fmt: skip
    additive = _table(2, lambda s: 0.5 + 0.1 * len(s))
    res = credit_differences(torch.stack([flat, cancel, additive]), torch.tensor([2, 2, 2]))
    assert res.v_any_changes == pytest.approx(2 / 3, abs=1e-15)
    assert res.v_full_changes == pytest.approx(1 / 3, abs=1e-15) and res.n_gain == 1


# Three 3-player games, φ by hand (φ_j = ⅓Δ_j(∅) + ⅙Δ_j({k}) + ⅙Δ_j({l}) + ⅓Δ_j({k, l})):
# A: singleton (.2, .2, 0) ties 0 and 1 where φ = (19, 10, 7)/60 orders them; LOO (.4, .1, .2)
#    strictly reverses 1 and 2.
TIE_A = {frozenset(): 0.0, frozenset({0}): 0.2, frozenset({1}): 0.2, frozenset({2}): 0.0,
         frozenset({0, 1}): 0.4, frozenset({0, 2}): 0.5, frozenset({1, 2}): 0.2,
         frozenset({0, 1, 2}): 0.6}  # fmt: skip
# B: singleton (.4, .1, .1) strictly reverses 0 against 1 and 2 (φ = (14, 23, 23)/60); LOO
#    (0, .6, .6) orders like φ, ties included.
REVERSED_B = {frozenset(): 0.0, frozenset({0}): 0.4, frozenset({1}): 0.1, frozenset({2}): 0.1,
              frozenset({0, 1}): 0.4, frozenset({0, 2}): 0.4, frozenset({1, 2}): 1.0,
              frozenset({0, 1, 2}): 1.0}  # fmt: skip
# C: LOO (.2, .2, .2) ties everything where φ = (17, 11, 8)/60 is strict; singleton (.3, .1, 0)
#    orders like φ.
TIE_C = {frozenset(): 0.0, frozenset({0}): 0.3, frozenset({1}): 0.1, frozenset({2}): 0.0,
         frozenset({0, 1}): 0.4, frozenset({0, 2}): 0.4, frozenset({1, 2}): 0.4,
         frozenset({0, 1, 2}): 0.6}  # fmt: skip


def test_hand_games_phi_closed_form() -> None:
    for game, phi in ((TIE_A, (19, 10, 7)), (REVERSED_B, (14, 23, 23)), (TIE_C, (17, 11, 8))):
        got = shapley_by_permutations(_sets(3, game), 3)
        assert_close(got, torch.tensor(phi, dtype=torch.float64) / 60, rtol=0.0, atol=1e-12)


def test_rank_readings_part_on_ties() -> None:
    """Bug (review): "orders differently" counted a tie on one side against a strict order on
    the other. Only B (singleton) and A (LOO) strictly reverse a pair; A (singleton) and C (LOO)
    only tie where Shapley orders."""
    additive = _table(3, lambda s: sum((0.3, 0.1, 0.2)[j] for j in s))
    tables = torch.stack([_sets(3, TIE_A), _sets(3, REVERSED_B), _sets(3, TIE_C), additive])
    res = credit_differences(tables, torch.tensor([3, 3, 3, 3]))
    assert res.singleton_rank_differs_tie_aware == 0.5  # A, B
    assert res.singleton_rank_reversed_strict == 0.25  # B
    assert res.leave_one_out_rank_differs_tie_aware == 0.5  # A, C
    assert res.leave_one_out_rank_reversed_strict == 0.25  # A


def _slow(values: torch.Tensor, n_actions: torch.Tensor, tol: float) -> dict[str, float]:
    """Per rollout, on its own m-player table, with Python loops."""
    diffs = {"singleton": 0, "leave_one_out": 0}
    reversed_ = {"singleton": 0, "leave_one_out": 0}
    gaps: dict[str, list[float]] = {"singleton": [], "leave_one_out": []}
    inter: list[float] = []
    changes = full_changes = 0
    for table, m in zip(values, n_actions.tolist(), strict=True):
        changes += bool(((table - table[0]).abs() > tol).any())
        full_changes += bool(abs(float(table[-1] - table[0])) > tol)
        if m == 0:
            continue
        t = table[: 2**m]
        phi = shapley_by_permutations(t, m).tolist()
        full = 2**m - 1
        credits = {
            "singleton": [float(t[1 << j] - t[0]) for j in range(m)],
            "leave_one_out": [float(t[full] - t[full ^ (1 << j)]) for j in range(m)],
        }

        def sign(x: float) -> int:
            return 0 if abs(x) <= tol else (1 if x > 0 else -1)

        gain = float(t[full] - t[0])
        for name, c in credits.items():
            pairs = list(itertools.combinations(range(m), 2))
            diffs[name] += any(sign(c[j] - c[k]) != sign(phi[j] - phi[k]) for j, k in pairs)
            reversed_[name] += any(
                sign(c[j] - c[k]) == -sign(phi[j] - phi[k]) != 0 for j, k in pairs
            )
            if abs(gain) > tol:
                gaps[name].append(
                    sum(abs(p - x) for p, x in zip(phi, c, strict=True)) / m / abs(gain)
                )
        for j, k in itertools.combinations(range(m), 2):
            rest = [i for i in range(m) if i not in (j, k)]
            total = 0.0
            for size in range(len(rest) + 1):
                for sub in itertools.combinations(rest, size):
                    s = sum(1 << i for i in sub)
                    w = math.factorial(size) * math.factorial(m - size - 2) / math.factorial(m - 1)
                    total += w * float(
                        t[s | 1 << j | 1 << k] - t[s | 1 << j] - t[s | 1 << k] + t[s]
                    )
            inter.append(total)
    n = len(values)
    return {
        "v_any_changes": changes / n,
        "v_full_changes": full_changes / n,
        "singleton_rank_differs_tie_aware": diffs["singleton"] / n,
        "singleton_rank_reversed_strict": reversed_["singleton"] / n,
        "leave_one_out_rank_differs_tie_aware": diffs["leave_one_out"] / n,
        "leave_one_out_rank_reversed_strict": reversed_["leave_one_out"] / n,
        "singleton_gap": sum(gaps["singleton"]) / len(gaps["singleton"]),
        "leave_one_out_gap": sum(gaps["leave_one_out"]) / len(gaps["leave_one_out"]),
        "interaction_mean": sum(inter) / len(inter),
        "interaction_abs_mean": sum(abs(x) for x in inter) / len(inter),
    }


@pytest.mark.parametrize("width", [2, 4, 5])
def test_equals_slow_reference_on_random_games(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    n = 40
    n_actions = torch.randint(1, width + 1, (n,), generator=g)
    levels = torch.randint(0, 4, (n, 2**width), generator=g).double() / 4  # ties happen
    masks = torch.arange(2**width)
    real_mask = (1 << n_actions) - 1  # (n,)
    values = levels.gather(1, (masks[None, :] & real_mask[:, None]))  # padded players are null
    got = credit_differences(values, n_actions).as_dict()
    want = _slow(values, n_actions, 1e-9)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
