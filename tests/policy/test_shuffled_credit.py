"""The `shuffled` placebo credit (`shuffle_credits`, `valid_permutation`) and the step's push
sizes (`advantage_metrics`): the same credits per rollout on other actions, drawn from a
generator fixed by (run seed, step); per-action modes push on groups of equal rewards."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from numpy.testing import assert_allclose

from policy.advantages import (
    CREDIT_MODES,
    DEFAULT_LAMBDA,
    CreditTable,
    ShapingConfig,
    advantage_metrics,
    group_advantages,
    shape_credits,
    shuffle_credits,
    token_advantages,
    valid_permutation,
)
from policy.trainer import step_seed

F64 = torch.float64


def _gen(seed: int, step: int) -> torch.Generator:
    """The trainer's shuffle generator of (run seed, step)."""
    return torch.Generator().manual_seed(step_seed(seed, step, "shuffled"))


def _credits() -> tuple[torch.Tensor, torch.Tensor]:
    """φ (B=2, G=3, m=5) with distinct values, and a mask with a middle pad, one and zero valid."""
    gen = torch.Generator().manual_seed(11)
    phi = torch.randn(2, 3, 5, generator=gen, dtype=F64)
    mask = torch.ones(2, 3, 5, dtype=torch.bool)
    mask[0, 1, 3:] = False  # trailing pads (collate's layout)
    mask[0, 2, 1] = False  # a pad in the middle
    mask[1, 0, 1:] = False  # one valid action
    mask[1, 1, :] = False  # none
    return phi, mask


def test_credit_table_has_one_field_per_mode() -> None:
    assert tuple(f for f in CreditTable.__dataclass_fields__) == CREDIT_MODES
    assert "shuffled" in CREDIT_MODES
    assert ShapingConfig(credit="shuffled").credit == "shuffled"


def test_shuffle_keeps_each_rollouts_credits_and_zeroes_pads() -> None:
    phi, mask = _credits()
    out = shuffle_credits(phi, mask, _gen(0, 0))
    idx = valid_permutation(mask, _gen(0, 0))
    assert torch.equal(out, torch.where(mask, phi.gather(-1, idx), 0.0))
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    moved = 0
    for b, g in itertools.product(range(2), range(3)):
        valid = mask[b, g].nonzero().squeeze(-1)
        assert sorted(idx[b, g, valid].tolist()) == valid.tolist()  # a bijection of valid slots
        pads = (~mask[b, g]).nonzero().squeeze(-1)
        assert torch.equal(idx[b, g, pads], pads)
        assert torch.equal(out[b, g, valid].sort().values, phi[b, g, valid].sort().values)
        moved += int(not torch.equal(out[b, g], torch.where(mask[b, g], phi[b, g], 0.0)))
    assert moved >= 2  # the seeded draw moves credit in several rollouts


def test_permutation_is_uniform_over_the_valid_slots() -> None:
    n = 6000
    mask = torch.tensor([True, False, True, True]).expand(n, 4)
    idx = valid_permutation(mask, torch.Generator().manual_seed(3))
    assert torch.equal(idx[:, 1], torch.ones(n, dtype=torch.int64))
    perms = [tuple(r) for r in idx[:, [0, 2, 3]].tolist()]
    for p in itertools.permutations((0, 2, 3)):
        share = perms.count(p) / n
        assert abs(share - 1 / 6) < 4 * math.sqrt((1 / 6) * (5 / 6) / n), (p, share)


def test_shuffle_is_fixed_by_seed_and_step_and_leaves_the_global_rng() -> None:
    phi, mask = _credits()
    rng = torch.get_rng_state()
    first = shuffle_credits(phi, mask, _gen(7, 3))
    assert torch.equal(torch.get_rng_state(), rng)  # the data order and sampling are untouched
    assert torch.equal(first, shuffle_credits(phi, mask, _gen(7, 3)))  # a resumed run replays it
    assert not torch.equal(first, shuffle_credits(phi, mask, _gen(7, 4)))  # the next step
    assert not torch.equal(first, shuffle_credits(phi, mask, _gen(8, 3)))  # another seed


@pytest.mark.parametrize("kappa", [0.5, 2.0])
def test_shaped_shuffled_credit_is_the_permuted_shaped_shapley(kappa: float) -> None:
    """Shaping is permutation-equivariant within a rollout (the group scale is a multiset
    statistic), so shuffled's x is shapley's x permuted: the same |x| in every rollout."""
    phi, mask = _credits()
    idx = valid_permutation(mask, _gen(0, 5))
    x_shapley = shape_credits(phi, mask, kappa)
    x_shuffled = shape_credits(shuffle_credits(phi, mask, _gen(0, 5)), mask, kappa)
    assert_allclose(x_shuffled.numpy(), x_shapley.gather(-1, idx).numpy(), rtol=0, atol=1e-14)
    assert bool((mask & (x_shapley.abs() >= kappa)).any())  # the box is active: ν matters
    assert_allclose(
        x_shuffled.abs().sum(-1).numpy(), x_shapley.abs().sum(-1).numpy(), rtol=0, atol=1e-14
    )


def _spans() -> tuple[torch.Tensor, torch.Tensor]:
    """2 rollouts, T = 5: action 0 = tokens 0–1, action 1 = token 2, token 3 shared (a
    separator), token 4 outside the loss."""
    spans = torch.zeros(2, 2, 5, dtype=torch.bool)
    spans[:, 0, 0:2] = True
    spans[:, 1, 2] = True
    loss = torch.tensor([[True] * 4 + [False]] * 2)
    return spans, loss


def test_advantage_metrics_closed_form_and_per_token_mean() -> None:
    """Zero-sum keeps the mean over a rollout's actions at A_i, not the mean over its action
    tokens when the spans differ in length: (2·(1 + λ) + (1 − λ)) / 3 ≠ 1."""
    spans, loss = _spans()
    base = torch.tensor([1.0, -0.5], dtype=F64)
    x = torch.tensor([[1.0, -1.0], [0.0, 0.0]], dtype=F64)
    lam = DEFAULT_LAMBDA
    adv = token_advantages(base, x, spans, loss, lam)
    out = advantage_metrics(adv, x, torch.ones(2, 2, dtype=torch.bool), spans, loss)
    on_action = [2 * (1 + lam) + (1 - lam), 3 * 0.5]  # Σ |A_t| over each rollout's action tokens
    assert_allclose(float(out["adv_abs_mean_action"]), sum(on_action) / 6, rtol=1e-15)
    assert_allclose(float(out["adv_abs_mean"]), (sum(on_action) + 1.0 + 0.5) / 8, rtol=1e-15)
    assert_allclose(float(out["shaping_abs_mean"]), 0.5, rtol=1e-15)
    assert_allclose(float(adv[0, :3].mean()), (3 + lam) / 3, rtol=1e-15)  # ≠ A_0 = 1


def test_tiny_credits_push_on_equal_rewards_but_broadcast_does_not() -> None:
    """A group of equal rewards (A = 0) with credits ±0.001: every per-action mode scales the
    spread to 1, so action tokens get λ/(1 + 10^-5); broadcast (x = 0) gives zero push."""
    spans, loss = _spans()
    rewards = torch.full((2,), 0.5, dtype=F64)
    phi = torch.tensor([[1e-3, -1e-3], [-1e-3, 1e-3]], dtype=F64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    table = CreditTable(
        shapley=phi, singleton=phi, leave_one_out=phi,
        broadcast=torch.full((2, 2), 0.5, dtype=F64),
        shuffled=shuffle_credits(phi, mask, _gen(0, 0)),
    )  # fmt: skip
    y = 1e-3 / (1e-3 + 1e-8)  # c / (s_g + SCALE_EPS) with s_g = 10^-3
    for mode in CREDIT_MODES:
        adv = group_advantages(rewards, table, mask, ShapingConfig(credit=mode))  # type: ignore[arg-type]
        assert torch.equal(adv.base, torch.zeros(2, dtype=F64))
        tok = token_advantages(adv.base, adv.x, spans, loss, DEFAULT_LAMBDA)
        out = advantage_metrics(tok, adv.x, mask, spans, loss)
        push = 0.0 if mode == "broadcast" else DEFAULT_LAMBDA * y
        assert_allclose(float(out["adv_abs_mean_action"]), push, rtol=1e-14, atol=0)
        assert_allclose(float(out["adv_abs_mean"]), 0.75 * push, rtol=1e-14, atol=0)
        assert_allclose(float(out["shaping_abs_mean"]), push / DEFAULT_LAMBDA, rtol=1e-14, atol=0)
