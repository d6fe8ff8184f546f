"""Math of policy/advantages.py: closed forms, projection properties, a QP reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose
from scipy.optimize import minimize

import policy.advantages as advantages_module
from policy.advantages import (
    CREDIT_MODES,
    DEFAULT_KAPPA,
    DEFAULT_LAMBDA,
    CreditTable,
    ShapingConfig,
    base_advantages,
    group_advantages,
    project_zero_sum_box,
    scale_credits,
    select_credit,
    shape_credits,
    shuffle_credits,
    token_advantages,
)

F64 = torch.float64
SUM_TOL = 1e-12
HYP = settings(max_examples=60, deadline=None, derandomize=True)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def qp_reference(y: np.ndarray, kappa: float) -> np.ndarray:
    """argmin ½‖x − y‖² s.t. Σx = 0, −κ ≤ x ≤ κ, by a generic solver (SLSQP)."""
    res = minimize(
        lambda x: 0.5 * np.sum((x - y) ** 2),
        x0=np.zeros_like(y),
        jac=lambda x: x - y,
        bounds=[(-kappa, kappa)] * len(y),
        constraints=[{"type": "eq", "fun": np.sum, "jac": np.ones_like}],
        method="SLSQP",
        options={"ftol": 1e-13, "maxiter": 1000},
    )
    # status 8 ("positive directional derivative"): no descent left, i.e. already optimal
    assert res.status in (0, 8), res.message
    assert abs(res.x.sum()) < 1e-8 and np.all(np.abs(res.x) <= kappa + 1e-9)
    return np.asarray(res.x)


def dykstra_reference(y: np.ndarray, kappa: float, iters: int = 20_000) -> np.ndarray:
    """The same projection by Dykstra's alternating projections (hyperplane, then box)."""
    x, p, q = y.copy(), np.zeros_like(y), np.zeros_like(y)
    for _ in range(iters):
        z = x + p
        h = z - z.mean()  # onto {Σ = 0}
        p = z - h
        w = h + q
        x_new = np.clip(w, -kappa, kappa)  # onto the box
        q = w - x_new
        if np.max(np.abs(x_new - x)) < 1e-13 and abs(x_new.sum()) < 1e-12:
            return np.asarray(x_new)
        x = x_new
    return x


# ---------------------------------------------------------------------------- base advantages


def test_base_advantages_closed_forms() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    std = math.sqrt(1.0 / 3.0)  # unbiased std of {1, 0, 0, 1}
    assert_allclose(_np(base_advantages(r, "grpo")), np.array([1, -1, -1, 1]) * 0.5 / (std + 1e-6))
    assert_allclose(_np(base_advantages(r, "drgrpo")), [0.5, -0.5, -0.5, 0.5])
    assert_allclose(_np(base_advantages(r, "rloo")), [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_base_advantages_batched_rowwise_and_rloo_identity() -> None:
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(3, 6, generator=gen, dtype=F64)
    for est in ("grpo", "drgrpo", "rloo"):
        batched = base_advantages(r, est)
        rows = torch.stack([base_advantages(row, est) for row in r])
        assert_allclose(_np(batched), _np(rows), rtol=1e-12, atol=1e-15)
    # RLOO = G/(G−1) · Dr.GRPO
    assert_allclose(
        _np(base_advantages(r, "rloo")), _np(6 / 5 * base_advantages(r, "drgrpo")), rtol=1e-12
    )


@pytest.mark.parametrize("est", ["grpo", "drgrpo", "rloo"])
def test_base_advantages_single_rollout_and_equal_rewards_are_zero(est: str) -> None:
    one = base_advantages(torch.tensor([0.7], dtype=F64), est)  # type: ignore[arg-type]
    assert torch.equal(one, torch.zeros(1, dtype=F64))
    same = base_advantages(torch.full((2, 4), 0.3, dtype=F64), est)  # type: ignore[arg-type]
    assert torch.equal(same, torch.zeros_like(same))


@pytest.mark.parametrize("est", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_equal_rewards_give_exactly_zero_for_every_group_size(est: str, dtype: torch.dtype) -> None:
    """docs/methods.md §2.1: equal rewards give exactly 0. The mean of G equal values misses
    them by a rounding step for many G (float32 G = 8: half of 2,000 values), which grpo's
    division by std + 1e-6 turned into a group-wide push of up to 0.12 (the MIPU check casts
    its rewards to float32). Other groups keep the estimator's values bit for bit."""
    values = torch.rand(2000, generator=torch.Generator().manual_seed(0), dtype=F64)
    for g in range(2, 17):
        equal = values[:, None].expand(-1, g).to(dtype)
        out = base_advantages(equal, est)  # type: ignore[arg-type]
        assert torch.equal(out, torch.zeros_like(out)), (g, out.abs().max())
        mixed = torch.rand(50, g, generator=torch.Generator().manual_seed(g), dtype=dtype)
        raw = advantages_module._ESTIMATORS[est](mixed, advantages_module.GRPO_STD_EPS)
        assert torch.equal(base_advantages(mixed, est), raw)  # type: ignore[arg-type]


def test_unknown_estimator_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"\['drgrpo', 'grpo', 'rloo'\]"):
        base_advantages(torch.zeros(3), "ppo")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- projection


def test_projection_closed_forms() -> None:
    ones = torch.ones(4, dtype=torch.bool)
    x = project_zero_sum_box(torch.tensor([5.0, 0.0, 0.0, 0.0], dtype=F64), ones, 2.0)
    assert_allclose(_np(x), [2.0, -2 / 3, -2 / 3, -2 / 3], rtol=1e-14)
    x = project_zero_sum_box(torch.tensor([3.0, 0.0, -3.0], dtype=F64), ones[:3], 2.0)
    assert_allclose(_np(x), [2.0, 0.0, -2.0], atol=1e-15)
    # already zero-sum, inside the box but not centred on 0 elementwise: unchanged
    y = torch.tensor([1.5, -0.25, -1.25], dtype=F64)
    assert_allclose(_np(project_zero_sum_box(y, ones[:3], 2.0)), _np(y), atol=1e-15)


vectors = st.integers(1, 8).flatmap(
    lambda m: st.tuples(
        st.lists(st.floats(-50, 50, allow_nan=False), min_size=m, max_size=m),
        st.lists(st.booleans(), min_size=m, max_size=m),
    )
)
kappas = st.floats(0.05, 5.0)


@HYP
@given(vectors, kappas)
def test_projection_properties(vm: tuple[list[float], list[bool]], kappa: float) -> None:
    y = torch.tensor(vm[0], dtype=F64)
    mask = torch.tensor(vm[1])
    x = project_zero_sum_box(y, mask, kappa)
    assert abs(float(x.sum())) <= SUM_TOL * max(1.0, float(y.abs().max()))
    assert float(x.abs().max()) <= kappa
    assert torch.equal(x[~mask], torch.zeros_like(x[~mask]))  # padding is 0
    yv, xv = y[mask], x[mask]
    order = yv.unsqueeze(0) >= yv.unsqueeze(1)  # [a, b] = y_b ≥ y_a
    assert bool((xv.unsqueeze(0) >= xv.unsqueeze(1))[order].all())  # order preserved
    if int(mask.sum()) <= 1:
        assert torch.equal(x, torch.zeros_like(x))
    # idempotent: x is zero-sum and in the box, so projecting it again leaves it unchanged
    assert_allclose(_np(project_zero_sum_box(x, mask, kappa)), _np(x), atol=1e-12)


@HYP
@given(vectors, kappas)
def test_projection_equals_generic_qp(vm: tuple[list[float], list[bool]], kappa: float) -> None:
    y = np.asarray(vm[0])
    mask = np.asarray(vm[1])
    x = project_zero_sum_box(torch.tensor(y, dtype=F64), torch.tensor(mask), kappa)
    if mask.sum() == 0:
        return
    assert_allclose(_np(x)[mask], qp_reference(y[mask], kappa), atol=1e-6)
    assert_allclose(_np(x)[mask], dykstra_reference(y[mask], kappa), atol=1e-6)


def test_projection_vectorized_over_rollouts_matches_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    y = 3 * torch.randn(4, 5, 7, generator=gen, dtype=F64)
    mask = torch.rand(4, 5, 7, generator=gen) > 0.25
    x = project_zero_sum_box(y, mask, 0.8)
    for idx in np.ndindex(4, 5):
        assert_allclose(_np(x[idx]), _np(project_zero_sum_box(y[idx], mask[idx], 0.8)), atol=1e-15)
    assert float(x.sum(-1).abs().max()) <= SUM_TOL


# ---------------------------------------------------------------------------- shaping


def _lopsided() -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout 0 puts all credit on action 0, rollout 1 is flat. y0 = [2√2, −√2/2 ×4]."""
    phi = torch.zeros(2, 5, dtype=F64)
    phi[0, 0] = 1.0
    return phi, torch.ones(2, 5, dtype=torch.bool)


def test_scale_credits_closed_form_and_unit_scale() -> None:
    phi, mask = _lopsided()
    y = scale_credits(phi, mask, "std")
    r2 = math.sqrt(2)
    assert_allclose(_np(y[0]), [2 * r2, -r2 / 2, -r2 / 2, -r2 / 2, -r2 / 2], rtol=1e-6)
    assert_allclose(_np(y[1]), 0.0, atol=0)
    gen = torch.Generator().manual_seed(2)
    phi = torch.randn(6, 5, generator=gen, dtype=F64)
    mask = torch.rand(6, 5, generator=gen) > 0.3
    y = scale_credits(phi, mask, "std")[mask]
    assert_allclose(float(y.square().mean().sqrt()), 1.0, rtol=1e-7)  # population std 1
    y = scale_credits(phi, mask, "mean_abs")[mask]
    assert_allclose(float(y.abs().mean()), 1.0, rtol=1e-7)


def test_lopsided_group_projection_is_zero_sum_but_independent_clip_drifts() -> None:
    phi, mask = _lopsided()
    x = shape_credits(phi, mask, kappa=2.0, mode="projection")
    assert_allclose(_np(x[0]), [2.0, -0.5, -0.5, -0.5, -0.5], rtol=1e-6)
    clipped = shape_credits(phi, mask, kappa=2.0, mode="independent_clip")
    assert_allclose(float(clipped.sum()), 2 - 2 * math.sqrt(2), rtol=1e-6)  # ≈ −0.83, ≠ 0
    # mean over (rollout, action) of A_i + λ x_ij equals the mean of A_i only with projection
    base = torch.tensor([0.7, -0.7], dtype=F64)
    lam = DEFAULT_LAMBDA
    shaped = base.unsqueeze(-1) + lam * x  # (G, m) per-action advantages
    assert_allclose(_np(shaped.mean(-1)), _np(base), rtol=0, atol=1e-15)  # per rollout
    drifted = base.unsqueeze(-1) + lam * clipped
    drift = lam * (2 - 2 * math.sqrt(2)) / 10  # Σ over the group / (G·m)
    assert_allclose(float(drifted.mean() - base.mean()), drift, rtol=1e-6)
    assert abs(drift) > 0.04


def test_mode_none_is_the_scaled_credit() -> None:
    phi, mask = _lopsided()
    assert torch.equal(shape_credits(phi, mask, mode="none"), scale_credits(phi, mask))


@pytest.mark.parametrize("mode", ["projection", "none", "independent_clip"])
def test_equal_credits_and_single_actions_give_exact_zeros(mode: str) -> None:
    phi = torch.tensor([[0.1, 0.1, 0.1], [0.3, -7.0, 2.0], [5.0, 5.0, 5.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
    x = shape_credits(phi, mask, mode=mode)  # type: ignore[arg-type]
    assert torch.equal(x, torch.zeros_like(x))
    one = shape_credits(torch.tensor([[4.2]], dtype=F64), torch.tensor([[True]]), mode=mode)  # type: ignore[arg-type]
    assert torch.equal(one, torch.zeros_like(one))  # G = 1, m = 1: 0, not NaN


def test_padded_actions_get_zero_and_do_not_count() -> None:
    gen = torch.Generator().manual_seed(3)
    phi = torch.randn(4, 6, generator=gen, dtype=F64)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    garbage = torch.where(mask, phi, torch.full_like(phi, 1e6))
    x = shape_credits(phi, mask, kappa=1.0)
    assert torch.equal(x[~mask], torch.zeros_like(x[~mask]))
    assert_allclose(_np(shape_credits(garbage, mask, kappa=1.0)), _np(x), atol=1e-15)


def test_shaping_invariant_to_rollout_shift_and_group_scale() -> None:
    gen = torch.Generator().manual_seed(4)
    phi = torch.randn(5, 4, generator=gen, dtype=F64)
    mask = torch.ones(5, 4, dtype=torch.bool)
    x = shape_credits(phi, mask, kappa=1.2)
    moved = 3.0 * phi + torch.randn(5, 1, generator=gen, dtype=F64)  # per-rollout shift
    assert_allclose(_np(shape_credits(moved, mask, kappa=1.2)), _np(x), atol=1e-7)


def test_batched_groups_are_scaled_separately() -> None:
    gen = torch.Generator().manual_seed(5)
    phi = torch.randn(3, 4, 5, generator=gen, dtype=F64) * torch.tensor([0.01, 1.0, 100.0])[
        :, None, None
    ].to(F64)
    mask = torch.rand(3, 4, 5, generator=gen) > 0.2
    x = shape_credits(phi, mask)
    for b in range(3):
        assert_allclose(_np(x[b]), _np(shape_credits(phi[b], mask[b])), atol=1e-15)


# ---------------------------------------------------------------------------- credit modes


def _table(gen: torch.Generator) -> CreditTable:
    g, m = 4, 5
    v_n = torch.rand(g, 1, generator=gen, dtype=F64)
    phi = torch.randn(g, m, generator=gen, dtype=F64)
    return CreditTable(
        shapley=phi,
        singleton=torch.rand(g, m, generator=gen, dtype=F64),
        leave_one_out=torch.rand(g, m, generator=gen, dtype=F64) - 0.5,
        broadcast=v_n.expand(g, m).clone(),
        shuffled=shuffle_credits(phi, torch.ones(g, m, dtype=torch.bool), gen),
    )


@pytest.mark.parametrize("mode", CREDIT_MODES)
def test_every_credit_mode_goes_through_the_same_shaping(mode: str) -> None:
    table = _table(torch.Generator().manual_seed(6))
    chosen = select_credit(table, mode)  # type: ignore[arg-type]
    assert chosen is getattr(table, mode)
    assert select_credit(dict(vars(table)), mode) is chosen  # type: ignore[arg-type]
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, 3:] = False
    x = shape_credits(chosen, mask, kappa=1.0)
    assert float(x.sum(-1).abs().max()) <= SUM_TOL
    assert float(x.abs().max()) <= 1.0
    assert torch.equal(x[~mask], torch.zeros_like(x[~mask]))
    if mode == "broadcast":  # equal credits within a rollout: no shaping at all
        assert torch.equal(x, torch.zeros_like(x))
    else:
        assert float(x.abs().max()) > 0.1


def test_select_credit_rejects_unknown_and_missing() -> None:
    table = _table(torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="leave_one_out"):
        select_credit(table, "banzhaf")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing"):
        select_credit({"shapley": table.shapley}, "singleton")


# ---------------------------------------------------------------------------- tokens


def test_token_advantages_maps_actions_shared_and_padding() -> None:
    base = torch.tensor([1.0, -0.5], dtype=F64)
    x = torch.tensor([[0.8, -0.8], [-1.5, 1.5]], dtype=F64)
    t = 7
    spans = torch.zeros(2, 2, t, dtype=torch.bool)
    spans[0, 0, 1:3] = True  # rollout 0: action 0 = tokens 1–2, action 1 = tokens 4–5
    spans[0, 1, 4:6] = True
    spans[1, 0, 0:2] = True  # rollout 1: action 0 = tokens 0–1, action 1 = token 2
    spans[1, 1, 2] = True
    response = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    lam = 0.5
    adv = token_advantages(base, x, spans, response, lam)
    expect = [
        [1.0, 1.4, 1.4, 1.0, 0.6, 0.6, 0.0],
        [-1.25, -1.25, 0.25, -0.5, 0.0, 0.0, 0.0],
    ]
    assert_allclose(_np(adv), expect, rtol=1e-14, atol=1e-15)
    batched = token_advantages(base[None], x[None], spans[None], response[None], lam)
    assert torch.equal(batched[0], adv)


def test_group_advantages_end_to_end_and_config_checks() -> None:
    gen = torch.Generator().manual_seed(8)
    tables = [_table(gen) for _ in range(2)]
    stacked = {k: torch.stack([vars(t)[k] for t in tables]) for k in CREDIT_MODES}
    rewards = torch.rand(2, 4, generator=gen, dtype=F64)
    mask = torch.ones(2, 4, 5, dtype=torch.bool)
    cfg = ShapingConfig(estimator="rloo", credit="singleton")
    out = group_advantages(rewards, stacked, mask, cfg)
    assert_allclose(_np(out.base), _np(base_advantages(rewards, "rloo")))
    for b in range(2):
        ref = shape_credits(tables[b].singleton, mask[b], DEFAULT_KAPPA)
        assert_allclose(_np(out.x[b]), _np(ref), atol=1e-15)
    assert float(out.metrics["max_abs_rollout_sum"]) <= SUM_TOL
    assert 0.0 <= float(out.metrics["clip_fraction"]) <= 1.0
    for bad in ({"kappa": 0.0}, {"lam": -1.0}, {"mode": "clip"}, {"credit": "x"}):
        with pytest.raises(ValueError):
            ShapingConfig(**bad)
