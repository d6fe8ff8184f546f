# mypy: disable-error-code="no-untyped-call"
# (torch.Tensor.backward is unannotated)
"""KL estimators and the dual-ascent controller; critic losses (dense, SP3O) and GAE."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from policy.losses import (
    CriticConfig,
    DualKLConfig,
    DualKLController,
    KLConfig,
    LossBatch,
    LossStack,
    StackConfig,
    anchor_mask,
    gae,
    kl_penalty,
)

F64 = torch.float64


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3_k2grad"])
def test_kl_estimators_vanish_at_the_reference(estimator: str) -> None:
    logp = torch.tensor([[-0.3, -2.0, -5.0]], dtype=F64, requires_grad=True)
    kl = kl_penalty(logp, logp.detach(), estimator)
    assert_close(kl, torch.zeros_like(kl))
    kl.sum().backward()
    expected_grad = 1.0 if estimator == "k1" else 0.0  # k1's gradient is 1 everywhere
    assert_close(logp.grad, torch.full_like(logp, expected_grad))


def test_k1_and_k3_match_exact_kl_in_expectation_by_enumeration() -> None:
    g = torch.Generator().manual_seed(0)
    pi = torch.softmax(torch.randn(7, generator=g, dtype=F64), 0)
    ref = torch.softmax(torch.randn(7, generator=g, dtype=F64), 0)
    exact = (pi * (pi.log() - ref.log())).sum()
    for est in ("k1", "k3"):  # E_{y∼π}[k(y)] = KL(π‖π_ref)
        assert_close((pi * kl_penalty(pi.log(), ref.log(), est)).sum(), exact)
    k2 = (pi * kl_penalty(pi.log(), ref.log(), "k2")).sum()
    assert (k2 - exact).abs() > 1e-3  # k2 is biased: the test distinguishes estimators


def test_estimator_gradients_and_straight_through_k3_value_k2_gradient() -> None:
    l = torch.tensor([[0.5, -0.7, 1.2]], dtype=F64)  # noqa: E741
    ref = torch.full_like(l, -1.0)
    grads = {}
    for est in ("k1", "k2", "k3", "k3_k2grad"):
        logp = (ref + l).requires_grad_(True)
        value = kl_penalty(logp, ref, est)
        value.sum().backward()
        grads[est] = (value.detach(), logp.grad)
    assert_close(grads["k2"][1], l)
    assert_close(grads["k3"][1], 1 - torch.exp(-l))
    assert_close(grads["k3_k2grad"][0], torch.exp(-l) + l - 1)  # k3 value
    assert_close(grads["k3_k2grad"][1], l)  # k2 gradient


def test_dual_kl_controller_moves_up_above_budget_down_below_and_is_clipped() -> None:
    cfg = DualKLConfig(budget=0.01, lr=1.0, ema=0.1, coef_init=0.5, coef_min=0.0, coef_max=1.0)
    up = DualKLController(cfg)
    lam = [up.update(0.05) for _ in range(3)]  # EMA of min(0.05, 0.02) = 0.02 > 0.01
    assert lam[0] == pytest.approx(0.5 + 0.01) and lam[0] < lam[1] < lam[2]
    down = DualKLController(cfg)
    assert down.update(0.0) == pytest.approx(0.5 - 0.01)
    hi = DualKLController(DualKLConfig(budget=0.01, lr=100.0, coef_init=0.9))
    assert hi.update(1.0) == 1.0  # clipped at coef_max
    assert hi.update(-5.0) < 1.0
    lo = DualKLController(DualKLConfig(budget=0.01, lr=100.0, coef_init=0.0))
    assert lo.update(0.0) == 0.0  # clipped at coef_min
    state = up.state_dict()
    fresh = DualKLController(cfg)
    fresh.load_state_dict(state)
    assert fresh.update(0.05) == up.update(0.05)


def test_a_non_finite_kl_leaves_the_dual_controller_as_it_was() -> None:
    """A skipped step's NaN KL passed min / max into λ and the EMA: λ stayed NaN for good and
    every later loss (pg + NaN·kl) was skipped too, in silence."""
    ctrl = DualKLController(DualKLConfig(budget=0.01, lr=1.0, coef_init=0.3))
    ctrl.update(0.02)
    before = ctrl.state_dict()
    for bad in (float("nan"), float("inf"), torch.tensor(float("nan"))):
        assert ctrl.update(bad) == before["coef"] and ctrl.state_dict() == before
    assert math.isfinite(ctrl.update(0.0))


def test_stack_uses_controller_coefficient() -> None:
    cfg = StackConfig(kl=KLConfig(estimator="k1", dual=DualKLConfig(coef_init=0.25)))
    stack = LossStack(cfg)
    assert set(stack.controllers) == {"kl"} and stack.coefficient("kl") == 0.25
    logp = torch.tensor([[-1.0, -1.0]], dtype=F64, requires_grad=True)
    b = LossBatch(
        logp=logp,
        old_logp=logp.detach(),
        sampler_logp=logp.detach(),
        advantages=torch.zeros_like(logp),
        response_mask=torch.ones(1, 2, dtype=torch.bool),
        ref_logp=logp.detach() - 0.4,
    )
    loss, m = stack(b)
    assert_close(loss, torch.tensor(0.25 * 0.4, dtype=F64))
    assert_close(m["kl/value"], torch.tensor(0.4, dtype=F64))
    stack.update_controllers(m)  # once per optimizer step: KL 0.4 is above the budget, λ rises
    assert stack.coefficient("kl") > 0.25
    fresh = LossStack(cfg)
    fresh.load_state_dict(stack.state_dict())  # the resume state / MIPU snapshot
    assert fresh.coefficient("kl") == stack.coefficient("kl")


def test_sp3o_anchor_positions_use_each_responses_own_length() -> None:
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0, :10] = True  # L = 10 → 3, 6, 9 (and L − 1 = 9)
    mask[1, 2:9] = True  # left-padded, L = 7 → 2, 4, 6 → columns 4, 6, 8
    mask[2, :1] = True  # L = 1 → all anchors at 0
    anchors = anchor_mask(mask, (0.3, 0.6, 0.9))
    assert anchors[0].nonzero().flatten().tolist() == [3, 6, 9]
    assert anchors[1].nonzero().flatten().tolist() == [4, 6, 8]
    assert anchors[2].nonzero().flatten().tolist() == [0]


def _critic_batch(mask: torch.Tensor) -> LossBatch:
    g = torch.Generator().manual_seed(0)
    shape = mask.shape
    values = torch.randn(*shape, generator=g, dtype=F64).requires_grad_(True)
    return LossBatch(
        logp=torch.zeros(*shape, dtype=F64, requires_grad=True),
        old_logp=torch.zeros(*shape, dtype=F64),
        sampler_logp=torch.zeros(*shape, dtype=F64),
        advantages=torch.zeros(*shape, dtype=F64),
        response_mask=mask,
        values=values,
        old_values=values.detach() + 0.5 * torch.randn(*shape, generator=g, dtype=F64),
        returns=torch.randn(*shape, generator=g, dtype=F64),
    )


def test_sp3o_critic_gradient_touches_only_anchor_positions() -> None:
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, :20] = True
    mask[1, :13] = True
    b = _critic_batch(mask)
    cfg = StackConfig(critic=CriticConfig(kind="sp3o", coef=1.0, value_clip=None))
    loss, m = LossStack(cfg)(b)
    loss.backward()
    assert b.values is not None and b.values.grad is not None
    anchors = anchor_mask(mask, (0.3, 0.6, 0.9))
    assert torch.all(b.values.grad[~anchors] == 0)
    assert torch.all(b.values.grad[anchors] != 0)
    # closed form: ½ (V − R)² at anchors, weighted L_i / n_anchors_i, token-mean over 33 tokens
    assert b.returns is not None
    err = 0.5 * (b.values.detach() - b.returns) ** 2
    weight = torch.tensor([[20 / 4], [13 / 4]], dtype=F64)  # 4 distinct anchors each
    assert_close(loss, (err * anchors * weight).sum() / 33)
    assert_close(m["critic/anchor_frac"], torch.tensor(8 / 33, dtype=F64))


def test_dense_critic_value_clipping_closed_form() -> None:
    mask = torch.ones(1, 4, dtype=torch.bool)
    values = torch.tensor([[1.0, 1.0, 0.0, 3.0]], dtype=F64, requires_grad=True)
    b = LossBatch(
        logp=torch.zeros(1, 4, dtype=F64, requires_grad=True),
        old_logp=torch.zeros(1, 4, dtype=F64),
        sampler_logp=torch.zeros(1, 4, dtype=F64),
        advantages=torch.zeros(1, 4, dtype=F64),
        response_mask=mask,
        values=values,
        old_values=torch.tensor([[0.0, 0.9, 0.0, 0.0]], dtype=F64),
        returns=torch.tensor([[2.0, 2.0, 1.0, 3.0]], dtype=F64),
    )
    loss, _ = LossStack(StackConfig(critic=CriticConfig(kind="dense", coef=1.0, value_clip=0.2)))(b)
    # tokens 0 and 3: V_old + clip(V − V_old, ±0.2) = 0.2 → (0.2 − R)² wins (3.24 > 1, 7.84 > 0)
    # and has zero gradient; tokens 1, 2 stay within the clip
    expected = 0.5 * torch.tensor([3.24, 1.0, 1.0, 7.84], dtype=F64)
    assert_close(loss, expected.mean())
    loss.backward()
    assert values.grad is not None
    assert_close(values.grad, torch.tensor([[0.0, -1.0, -1.0, 0.0]], dtype=F64) / 4)


def test_gae_closed_forms_and_padding() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.2, 0.1, 7.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)  # last token is padding
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(adv, torch.tensor([[0.5, 0.8, 0.9, 0.0]], dtype=F64))  # Σ future r − V
    assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64))
    adv0, _ = gae(rewards, values, mask, gamma=0.9, lam=0.0)  # one-step TD errors
    assert_close(adv0, torch.tensor([[0.9 * 0.2 - 0.5, 0.9 * 0.1 - 0.2, 0.9, 0.0]], dtype=F64))
