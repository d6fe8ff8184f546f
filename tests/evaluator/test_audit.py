"""The evaluator audit on evaluator pairs whose answers are known in closed form.

identical → 1.0 everywhere; negated → 0.0; reference = training + Gaussian noise → agreement
Φ(c / (σ√2)) for marginals and Φ(c / (σ‖W_j‖)) for φ, inside the bootstrap CI; hand-counted
ties; a pair whose verdict flips at a chosen size; the cheap-credit table on games where the
answer is known; padding changes nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from evaluator.audit import AuditConfig, Games, audit, cheap_credit_by_m, recommend
from evaluator.audit_stats import bootstrap_ratio, kendall_tau_b, marginal_index, tol_sign
from evaluator.shapley import coalition_masks, coalition_sizes, shapley_weight_matrix

FAST = AuditConfig(n_boot=400)
EXACT = AuditConfig(n_boot=400, tol=0.0)  # continuous random tables: no ties at tol 0


def _random_games(
    n_queries: int, per_query: int, m: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Continuous random value tables (no ties) and their query ids."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.rand(n_queries * per_query, 2**m, generator=gen, dtype=torch.float64)
    groups = torch.arange(n_queries).repeat_interleave(per_query)
    return values, groups


def _additive(a: torch.Tensor) -> torch.Tensor:
    """v(S) = Σ_{j∈S} a_j for a batch of weights a (R, m) → (R, 2^m)."""
    return a @ coalition_masks(a.shape[1]).double().T


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _full(n: int, m: int) -> torch.Tensor:
    return torch.full((n,), m, dtype=torch.int64)


def _lift(table: torch.Tensor, m: int, width: int) -> torch.Tensor:
    """Pad an m-player table (R, 2^m) to ``width`` players with null players:
    v'(S) = v(S ∩ {0..m−1}) → (R, 2^width)."""
    restricted = (coalition_masks(width)[:, :m].long() * (1 << torch.arange(m))).sum(1)
    return table[:, restricted]


def test_marginal_index_enumerates_every_pair_once() -> None:
    idx = marginal_index(4)
    assert idx.without.numel() == 4 * 2**3
    assert bool(((idx.without >> idx.player) & 1 == 0).all())
    assert bool((idx.with_j == idx.without | (1 << idx.player)).all())
    # pairs at size k: m · C(m−1, k−1) = 4, 12, 12, 4
    assert torch.bincount(idx.size, minlength=5)[1:].tolist() == [4, 12, 12, 4]


def test_identical_evaluators_agree_everywhere() -> None:
    values, groups = _random_games(30, 4, 4, seed=1)
    res = audit(Games(values, values.clone(), _full(120, 4), groups), EXACT)
    assert_close(res.sizes.agree.estimate, torch.ones(4, dtype=torch.float64))
    assert_close(res.sizes.agree.low, torch.ones(4, dtype=torch.float64))
    assert float(res.phi_agree.estimate[0]) == 1.0 and float(res.kendall.estimate[0]) == 1.0
    assert float(res.top_agree.estimate[0]) == 1.0
    assert res.recommended == "shapley" and res.verdict == "agrees"
    assert res.sizes.n_pairs.tolist() == [480.0, 1440.0, 1440.0, 480.0]


def test_negated_evaluator_agrees_nowhere() -> None:
    values, groups = _random_games(30, 4, 4, seed=2)
    res = audit(Games(values, -values, _full(120, 4), groups), EXACT)
    assert_close(res.sizes.agree.estimate, torch.zeros(4, dtype=torch.float64))
    assert_close(res.sizes.agree.high, torch.zeros(4, dtype=torch.float64))
    assert float(res.phi_agree.estimate[0]) == 0.0
    assert float(res.kendall.estimate[0]) == pytest.approx(-1.0, abs=1e-12)
    assert float(res.top_agree.estimate[0]) == 0.0
    assert res.recommended == "none" and res.verdict == "disagrees"


def test_noisy_reference_matches_closed_form_within_ci() -> None:
    """Training: additive game with |a_j| = c. Reference = training + N(0, σ²) per coalition.
    Every marginal of the reference is a_j + (ε_{S∪j} − ε_S): P(same sign) = Φ(c / (σ√2)).
    φ_ref,j = a_j + Σ_S W[S, j] ε_S: P(same sign) = Φ(c / (σ ‖W_{·j}‖)).
    Checked against 99 % intervals (5 intervals: a miss would be a ~5 % event for a correct
    estimator; over seeds 0-7 the estimates scatter evenly around Φ(1/√2))."""
    m, c, sigma, n_q, g = 4, 1.0, 1.0, 400, 4
    gen = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (n_q * g, m), generator=gen).double() * 2 - 1
    train = _additive(c * signs)
    ref = train + sigma * torch.randn(train.shape, generator=gen, dtype=torch.float64)
    res = audit(
        Games(train, ref, _full(n_q * g, m), torch.arange(n_q).repeat_interleave(g)),
        AuditConfig(tol=0.0, n_boot=1000, level=0.99),
    )
    p_marginal = _normal_cdf(c / (sigma * math.sqrt(2.0)))  # Φ(1/√2) = 0.7602
    assert p_marginal == pytest.approx(0.760250, abs=1e-6)
    for k in range(m):
        lo, hi = float(res.sizes.agree.low[k]), float(res.sizes.agree.high[k])
        assert lo <= p_marginal <= hi, (k, lo, hi)
        assert hi - lo < 0.06  # the interval is informative, not vacuous
    w_norm = float(shapley_weight_matrix(m)[:, 0].norm())
    p_phi = _normal_cdf(c / (sigma * w_norm))
    assert float(res.phi_agree.low[0]) <= p_phi <= float(res.phi_agree.high[0])
    assert float(res.sizes.ties_both.sum()) == 0.0


def test_ties_are_counted_apart_by_hand() -> None:
    """m = 2, tol = 1e-6. Training marginals: size 1 (+0.3, 0), size 2 (+0.3, 0).
    Reference: size 1 (+0.2, 5e-7 → tie), size 2 (+0.1 − 5e-7, −0.1)."""
    train = torch.tensor([[0.0, 0.3, 0.0, 0.3]], dtype=torch.float64)
    ref = torch.tensor([[0.0, 0.2, 5e-7, 0.1]], dtype=torch.float64)
    res = audit(Games(train, ref, _full(1, 2), torch.zeros(1, dtype=torch.int64)), FAST)
    s = res.sizes
    assert s.agree.estimate.tolist() == [1.0, 0.5]
    assert s.ties_both.tolist() == [0.5, 0.0]
    assert s.ties_train_only.tolist() == [0.0, 0.5] and s.ties_reference_only.tolist() == [0.0, 0.0]
    assert s.decisive.estimate.tolist() == [1.0, 1.0]  # one decisive pair per size, agreeing
    assert s.passed.tolist() == [True, False] and res.recommended == "singleton"
    # at tol = 0 the reference's 5e-7 is no longer a tie: size 1 drops to 1/2
    assert res.sweep[0.0].tolist() == [0.5, 0.5] and res.sweep[1e-3].tolist() == [1.0, 0.5]


@pytest.mark.parametrize("flip_at", [2, 3, 4])
def test_verdict_flips_at_the_chosen_size(flip_at: int) -> None:
    """Training v(S) = |S| (every marginal +1); reference v(S) = g(|S|) rising by 1 up to size
    flip_at − 1, then falling by 1: agreement 1 below flip_at, 0 from flip_at on."""
    m = 4
    sizes = coalition_sizes(m).double()
    peak = flip_at - 1
    ref_row = torch.where(sizes <= peak, sizes, 2 * peak - sizes)
    n = 40
    train, ref = sizes.expand(n, -1).clone(), ref_row.expand(n, -1).clone()
    res = audit(Games(train, ref, _full(n, m), torch.arange(n) // 4), FAST)
    expected = [1.0 if k < flip_at else 0.0 for k in range(1, m + 1)]
    assert res.sizes.agree.estimate.tolist() == expected
    assert res.sizes.passed.tolist() == [e == 1.0 for e in expected]
    assert res.recommended == "singleton" and res.verdict == "partial"


def test_leave_one_out_is_judged_on_each_rollouts_own_last_marginals() -> None:
    """Mixed m (free format, --from-run): leave-one-out reads v(N) − v(N ∖ {j}) at size m_r,
    not M. Before, the m = 4 rollouts passing size 4 recommended leave_one_out although every
    leave-one-out credit of the m = 2 rollouts had the wrong sign."""
    gen = torch.Generator().manual_seed(0)
    n = torch.tensor([4] * 10 + [2] * 10)
    weights = torch.rand(20, 4, generator=gen, dtype=torch.float64) + 0.1
    weights[n == 2, 2:] = 0.0  # additive games over the real players only
    ref = _additive(weights)
    train = ref.clone()
    train[10:] = -ref[10:]  # the m = 2 rollouts: every marginal has the opposite sign
    res = audit(Games(train, ref, n, torch.arange(20)), FAST)
    # size 4 holds only the m = 4 rollouts' marginals: it passes; size 1 (all rollouts) fails
    assert res.sizes.passed.tolist() == [False, True, True, True]
    assert res.leave_one_out is not None
    # 10 rollouts × 4 agreeing + 10 × 2 disagreeing last marginals
    assert float(res.leave_one_out.estimate[0]) == 40 / 60
    assert res.recommended == "none"
    # the m = 2 rollouts agreeing too: every last marginal agrees
    agree = audit(Games(ref.clone(), ref, n, torch.arange(20)), FAST)
    assert agree.leave_one_out is not None and float(agree.leave_one_out.estimate[0]) == 1.0
    has = torch.ones(4, dtype=torch.bool)
    last_only = torch.tensor([False, False, False, True])
    assert recommend(last_only, has, last_passed=False) == "none"
    assert recommend(torch.tensor([False, False, True, False]), has, last_passed=True) == (
        "leave_one_out"
    )


def test_only_the_largest_size_passing_recommends_leave_one_out() -> None:
    has = torch.ones(4, dtype=torch.bool)
    assert recommend(torch.tensor([False, False, False, True]), has) == "leave_one_out"
    assert recommend(torch.tensor([True, True, True, True]), has) == "shapley"
    assert recommend(torch.tensor([True, False, True, True]), has) == "singleton"
    assert recommend(torch.tensor([False, True, True, False]), has) == "none"
    # sizes without pairs are not judged
    assert (
        recommend(
            torch.tensor([True, True, False, False]), torch.tensor([True, True, False, False])
        )
        == "shapley"
    )


def test_padding_changes_nothing() -> None:
    """A rollout with m = 2 padded to M = 4 (null players) counts only its own pairs."""
    small, groups = _random_games(10, 2, 2, seed=3)
    noisy = small + 0.2 * torch.randn(
        small.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    plain = audit(Games(small, noisy, _full(20, 2), groups), FAST)
    padded = audit(Games(_lift(small, 2, 4), _lift(noisy, 2, 4), _full(20, 2), groups), FAST)
    assert_close(padded.sizes.agree.estimate[:2], plain.sizes.agree.estimate)
    assert padded.sizes.n_pairs.tolist() == [40.0, 40.0, 0.0, 0.0]
    assert padded.sizes.has_pairs.tolist() == [True, True, False, False]
    assert_close(padded.phi_agree.estimate, plain.phi_agree.estimate)
    assert_close(padded.kendall.estimate, plain.kendall.estimate)


def test_cheap_credit_table_on_known_games() -> None:
    """m = 2 and additive games: singleton and leave-one-out always order actions like φ.
    Redundant pair {0, 1} + independent 2 (m = 3): singleton puts 0, 1 above 2, φ puts 2 on
    top (2 of 3 pairs reversed); leave-one-out keeps φ's order."""
    two, _ = _random_games(5, 2, 2, seed=5)
    additive = _additive(
        torch.rand(6, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    )
    redundant = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.8, 1.8, 1.8, 1.8]], dtype=torch.float64)
    values = torch.cat([_lift(two, 2, 4), additive, _lift(redundant, 3, 4)])
    n = torch.tensor([2] * 10 + [4] * 6 + [3])
    table = cheap_credit_by_m(values, n, tol=1e-9)
    assert sorted(table) == [2, 3, 4]
    for m in (2, 4):
        assert all(float(v) == 0.0 for key, v in table[m].items() if key != "n_rollouts")
    row = table[3]
    assert float(row["n_rollouts"]) == 1.0
    assert (
        float(row["singleton_rank_differs"]) == 1.0 and float(row["singleton_top_differs"]) == 1.0
    )
    assert float(row["singleton_discordant_pairs"]) == pytest.approx(2 / 3)
    assert float(row["leave_one_out_rank_differs"]) == 0.0


def test_kendall_tau_b_matches_hand_counts() -> None:
    x = torch.tensor(
        [[1.0, 2.0, 3.0, 0.0], [1.0, 1.0, 2.0, 9.0], [5.0, 5.0, 5.0, 0.0]], dtype=torch.float64
    )
    y = torch.tensor(
        [[1.0, 3.0, 2.0, 0.0], [1.0, 2.0, 3.0, 9.0], [1.0, 2.0, 3.0, 0.0]], dtype=torch.float64
    )
    tau = kendall_tau_b(x, y, torch.tensor([3, 3, 3]), tol=0.0)
    # row 0: C = 2, D = 1 → 1/3; row 1: x ties one pair → (2 − 0)/√(2·3); row 2: x all tied → NaN
    assert float(tau[0]) == pytest.approx(1 / 3)
    assert float(tau[1]) == pytest.approx(2 / math.sqrt(6))
    assert math.isnan(float(tau[2]))


def test_bootstrap_ratio_is_seeded_and_brackets_the_estimate() -> None:
    gen = torch.Generator().manual_seed(0)
    num = torch.rand(50, 2, generator=gen, dtype=torch.float64)
    den = num + torch.rand(50, 2, generator=gen, dtype=torch.float64)
    a = bootstrap_ratio(num, den, n_boot=500, level=0.9, generator=torch.Generator().manual_seed(1))
    b = bootstrap_ratio(num, den, n_boot=500, level=0.9, generator=torch.Generator().manual_seed(1))
    assert_close(a.low, b.low) and assert_close(a.high, b.high)
    assert_close(a.estimate, num.sum(0) / den.sum(0))
    assert bool((a.low < a.estimate).all() and (a.estimate < a.high).all())
    assert tol_sign(torch.tensor([-1.0, -1e-7, 0.0, 2e-7, 3.0]), 1e-6).tolist() == [-1, 0, 0, 0, 1]


def test_bad_inputs_are_clear_errors() -> None:
    v = torch.zeros(2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="two \\(R, 2\\^M\\) tables"):
        audit(
            Games(
                v,
                torch.zeros(2, 4, dtype=torch.float64),
                _full(2, 3),
                torch.zeros(2, dtype=torch.int64),
            )
        )
    with pytest.raises(ValueError, match="n_actions must lie in 0..3"):
        audit(Games(v, v, _full(2, 4), torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="threshold"):
        AuditConfig(threshold=0.0)
