"""Paired bootstrap: closed-form cases, reproducibility, and agreement with the normal
approximation on a large sample."""

from __future__ import annotations

import numpy as np
import pytest

from evaluator.stats import paired_bootstrap


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
