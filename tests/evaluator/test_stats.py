"""Paired and two-level bootstraps, sign-flip test, Holm: closed-form cases, reproducibility,
agreement with the normal approximation and with the closed-form two-level variance, and the
one-seed effect that a claims-only bootstrap hides."""

from __future__ import annotations

import json

import numpy as np
import pytest

from evaluator.stats import (
    _two_level_means,
    holm,
    paired_bootstrap,
    sign_flip_equivalence,
    sign_flip_test,
    two_level_bootstrap,
    two_level_variance,
)


def test_identical_modes_give_p_one_half_and_a_zero_ci() -> None:
    a = np.random.default_rng(0).uniform(size=300)
    res = paired_bootstrap(a, a.copy())
    assert res.p_one_sided == 0.5 and res.mean_diff == 0.0
    assert res.ci_low == 0.0 and res.ci_high == 0.0 and res.n_resamples == 10_000


@pytest.mark.parametrize("shift", [0.01, -0.02])
def test_constant_shift_ci_is_the_shift_and_excludes_zero(shift: float) -> None:
    b = np.random.default_rng(1).uniform(size=100)
    res = paired_bootstrap(b + shift, b)
    assert res.ci_low == pytest.approx(shift, abs=1e-12)
    assert res.ci_high == pytest.approx(shift, abs=1e-12)
    assert not res.ci_low <= 0 <= res.ci_high
    assert res.p_one_sided == (0.0 if shift > 0 else 1.0)


def test_seeded_and_close_to_the_normal_approximation() -> None:
    rng = np.random.default_rng(2)
    b = rng.uniform(size=2000)
    a = b + rng.normal(0.01, 0.1, size=2000)
    one, two = paired_bootstrap(a, b, seed=5), paired_bootstrap(a, b, seed=5)
    assert one == two
    d = a - b
    se = d.std(ddof=1) / np.sqrt(d.size)
    assert one.ci_low == pytest.approx(d.mean() - 1.96 * se, abs=0.1 * se)
    assert one.ci_high == pytest.approx(d.mean() + 1.96 * se, abs=0.1 * se)
    from math import erf, sqrt

    p_normal = 0.5 * (1 + erf(-d.mean() / se / sqrt(2)))  # P(mean ≤ 0)
    assert one.p_one_sided == pytest.approx(p_normal, abs=0.01)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        paired_bootstrap([1.0, float("nan")], [1.0, 2.0])


# --- two-level bootstrap ------------------------------------------------------------------


def test_two_level_identical_modes_give_p_one_half_and_a_zero_ci() -> None:
    a = np.random.default_rng(0).uniform(size=(5, 200))
    res = two_level_bootstrap(a, a.copy())
    assert res.p_one_sided == 0.5 and res.mean_diff == 0.0 and res.sd == 0.0
    assert res.ci_low == 0.0 and res.ci_high == 0.0
    assert res.per_seed_diff == (0.0,) * 5
    assert res.sign_flip_p == 1.0  # every sign assignment ties with the observed 0
    assert (res.n_seeds, res.n_claims, res.n_resamples) == (5, 200, 10_000)


def test_two_level_constant_shift_excludes_zero() -> None:
    rng = np.random.default_rng(1)
    b = rng.uniform(size=(5, 200))
    a = b + 0.01 + rng.normal(0, 0.005, size=b.shape)
    res = two_level_bootstrap(a, b)
    assert res.mean_diff == pytest.approx(0.01, abs=5e-4)
    assert 0 < res.ci_low < res.mean_diff < res.ci_high
    assert res.p_one_sided == 0.0  # the grand mean sits ~45 bootstrap sd above 0
    assert res.sign_flip_p == pytest.approx(1 / 32)  # all five seeds positive: identity only


def test_one_seed_effect_widens_the_interval_far_beyond_claims_only() -> None:
    # Seed 0 carries +0.05 on every claim, the other five seeds only noise. Claims-only on the
    # seed means sees a tight +0.05/6; the two-level bootstrap sees k ~ Binomial(6, 1/6) copies
    # of seed 0, mean ≈ 0.05 k / 6: P(k = 0) = 0.33 puts the 2.5 % point at ≈ 0 and
    # P(k ≥ 3) = 0.062 > 0.025 > P(k ≥ 4) = 0.009 puts the 97.5 % point at ≈ 0.025.
    rng = np.random.default_rng(3)
    n_seeds, n_claims, noise = 6, 300, 0.01
    d = rng.normal(0, noise, size=(n_seeds, n_claims))
    d[0] += 0.05
    b = rng.uniform(size=d.shape)
    two = two_level_bootstrap(b + d, b)
    flat = paired_bootstrap((b + d).mean(axis=0), b.mean(axis=0))
    assert two.ci_low == pytest.approx(0.0, abs=2e-3)
    assert two.ci_high == pytest.approx(3 * 0.05 / n_seeds, abs=2e-3)
    claims_se = noise / np.sqrt(n_seeds * n_claims)
    assert flat.ci_high - flat.ci_low == pytest.approx(2 * 1.96 * claims_se, rel=0.1)
    ratio = (two.ci_high - two.ci_low) / (flat.ci_high - flat.ci_low)
    assert ratio > 20  # the design predicts 0.025 / 0.00092 ≈ 27 (measured 28.0)
    assert flat.p_one_sided == 0.0 and two.p_one_sided > 0.025  # only claims-only "rejects"
    assert two.per_seed_diff[0] == pytest.approx(0.05, abs=3 * noise / np.sqrt(n_claims))


def test_bootstrap_variance_matches_the_closed_form() -> None:
    rng = np.random.default_rng(4)
    n_seeds, n_claims, n_resamples = 8, 50, 40_000
    d = rng.normal(0, 0.02, size=(n_seeds, 1)) + rng.normal(0, 0.05, size=(n_seeds, n_claims))
    means = _two_level_means(d, n_resamples, seed=7)
    exact = two_level_variance(d)
    # sd of a variance estimate from B draws: var · sqrt((2 + excess kurtosis) / B) ≈ 0.7 %
    centred = means - means.mean()
    kurt = (centred**4).mean() / (centred**2).mean() ** 2 - 3
    rel_sd = np.sqrt((2 + kurt) / n_resamples)
    assert means.var(ddof=1) / exact == pytest.approx(1.0, abs=5 * rel_sd)
    assert means.mean() == pytest.approx(d.mean(), abs=5 * np.sqrt(exact / n_resamples))
    res = two_level_bootstrap(d, np.zeros_like(d), n_resamples=n_resamples, seed=7)
    assert res.sd == pytest.approx(means.std(ddof=1), rel=1e-12)


def test_two_level_variance_hand_example() -> None:
    # m = (1, 3), m̄ = 2, between = 1; σ² = (1, 0) over C = 2 -> within = ½ · ½ = ¼
    d = np.array([[0.0, 2.0], [3.0, 3.0]])
    assert two_level_variance(d) == pytest.approx((1 + 0.25) / 2, rel=1e-15)


def test_one_seed_reproduces_the_claims_only_bootstrap() -> None:
    rng = np.random.default_rng(5)
    a, b = rng.uniform(size=(1, 200)), rng.uniform(size=(1, 200))
    two, flat = two_level_bootstrap(a, b, seed=4), paired_bootstrap(a[0], b[0], seed=4)
    assert (two.ci_low, two.ci_high, two.p_one_sided) == (
        flat.ci_low,
        flat.ci_high,
        flat.p_one_sided,
    )
    assert two.mean_diff == pytest.approx(flat.mean_diff, rel=1e-15)
    assert two.sign_flip_p == 0.5  # S = 1: {+x, −x}, one of two is ≥ x


def test_two_level_is_seeded_and_json_ready() -> None:
    rng = np.random.default_rng(6)
    a, b = rng.uniform(size=(4, 60)), rng.uniform(size=(4, 60))
    one, two = two_level_bootstrap(a, b, seed=9), two_level_bootstrap(a, b, seed=9)
    assert one == two
    assert two_level_bootstrap(a, b, seed=10).ci_low != one.ci_low
    out = json.loads(json.dumps(one.as_dict(), allow_nan=False))
    assert out["per_seed_diff"] == pytest.approx((a - b).mean(axis=1).tolist(), rel=1e-15)
    assert out["sign_flip_p"] == sign_flip_test(one.per_seed_diff)
    wide = two_level_bootstrap(np.ones((21, 3)), np.zeros((21, 3)), n_resamples=10)
    assert wide.sign_flip_p is None and wide.as_dict()["sign_flip_p"] is None


def test_two_level_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="2-D"):
        two_level_bootstrap([1.0, 2.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="same shape"):
        two_level_bootstrap(np.ones((2, 3)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="non-empty"):
        two_level_bootstrap(np.ones((2, 0)), np.ones((2, 0)))
    with pytest.raises(ValueError, match="finite"):
        two_level_bootstrap([[1.0, np.inf]], [[1.0, 2.0]])
    with pytest.raises(ValueError, match="n_resamples"):
        two_level_bootstrap(np.ones((2, 2)), np.ones((2, 2)), n_resamples=0)
    with pytest.raises(ValueError, match="2-D"):
        two_level_variance(np.ones(3))


# --- sign-flip test and Holm --------------------------------------------------------------


@pytest.mark.parametrize(
    ("diffs", "p"),
    [
        ([1.0, 2.0, 3.0], 1 / 8),  # only the identity reaches 6
        ([3.0, -1.0], 2 / 4),  # sums 2, 4, -4, -2: {2, 4} ≥ 2
        ([0.0, 0.0], 1.0),  # all-zero: every sum ties with 0
        ([0.0, 1.0], 2 / 4),  # flipping the zero ties with the observed sum
        ([1.0, -1.0], 3 / 4),  # observed 0; ties with the full flip, beaten by (+1, +1)
        ([0.1, 0.2, -0.3], 5 / 8),  # observed ≈ 5.6e-17, its full flip ≈ −5.6e-17: a tie
    ],
)
def test_sign_flip_exact_values_and_ties(diffs: list[float], p: float) -> None:
    assert sign_flip_test(diffs) == p


def test_sign_flip_matches_brute_force() -> None:
    x = np.random.default_rng(7).normal(0.2, 1.0, size=10)
    signs = np.array(np.meshgrid(*[[1.0, -1.0]] * x.size)).reshape(x.size, -1).T  # (1024, 10)
    assert sign_flip_test(x) == np.mean(signs @ x >= x.sum() - 1e-12)


def test_sign_flip_two_sided_and_equivalence_match_brute_force() -> None:
    """The aggregate reported the one-sided sign-flip p for every kind of hypothesis: for
    shapley ≠ leave_one_out that was P(Σεm ≥ Σm) = 0.344, half the two-sided 0.688."""
    x = np.random.default_rng(3).normal(0.01, 0.02, size=6)
    signs = np.array(np.meshgrid(*[[1.0, -1.0]] * x.size)).reshape(x.size, -1).T  # (64, 6)
    assert sign_flip_test(x, "two_sided") == np.mean(np.abs(signs @ x) >= abs(x.sum()) - 1e-12)
    assert sign_flip_test([1.0, 2.0, 3.0], "two_sided") == 2 / 8  # the identity and its flip
    assert sign_flip_test([0.0, 0.0], "two_sided") == 1.0
    for margin in (0.005, 0.03):
        low = np.mean(signs @ (x + margin) >= (x + margin).sum() - 1e-12)
        high = np.mean(signs @ (margin - x) >= (margin - x).sum() - 1e-12)
        assert sign_flip_equivalence(x, margin) == max(low, high)
    # three seeds all well inside ±0.05: each one-sided test reaches its floor 1/8
    assert sign_flip_equivalence([0.0, 0.001, -0.001], 0.05) == 1 / 8
    with pytest.raises(ValueError, match="alternative"):
        sign_flip_test([1.0], "less")
    with pytest.raises(ValueError, match="margin must be > 0"):
        sign_flip_equivalence([1.0], 0.0)


def test_sign_flip_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="S = 21"):
        sign_flip_test(np.ones(21))
    with pytest.raises(ValueError, match="1-D"):
        sign_flip_test([])
    with pytest.raises(ValueError, match="finite"):
        sign_flip_test([1.0, np.nan])


def test_holm_hand_example() -> None:
    # sorted 0.01, 0.03, 0.04, 0.5 with m = 4: 0.04, 0.09, 0.08 -> 0.09 (monotone), 0.5
    got = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5})
    assert list(got) == ["a", "b", "c", "d"]
    assert got == pytest.approx({"a": 0.04, "b": 0.09, "c": 0.09, "d": 0.5}, rel=1e-15)
    assert holm({"x": 0.6, "y": 0.4}) == {"x": 0.8, "y": 0.8}  # 0.6 · 1 raised to 0.4 · 2
    capped = holm({"x": 0.3, "y": 0.6, "z": 0.9})  # 0.9, 1.2 -> 1, 0.9 -> 1 (monotone)
    assert capped == pytest.approx({"x": 0.9, "y": 1.0, "z": 1.0}, rel=1e-15)
    assert holm({"only": 0.3}) == {"only": 0.3} and holm({}) == {}


def test_holm_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm({"a": 1.5})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm({"a": float("nan")})
