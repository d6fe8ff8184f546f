# mypy: disable-error-code="no-untyped-call"
# (torch.Tensor.backward is unannotated)
"""PPO clip / dual-clip, GSPO and the staleness-adaptive clip: closed forms and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from policy.losses import ClipConfig, LossBatch, LossStack, StackConfig
from policy.losses.staleness import staleness_endpoints


def _batch(log_r: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor | None = None) -> LossBatch:
    """π/π_old = exp(log_r), π_old = μ (no mismatch). All (B, T) float64."""
    old = torch.full_like(log_r, -1.0)
    logp = (old + log_r).requires_grad_(True)
    m = torch.ones_like(log_r, dtype=torch.bool) if mask is None else mask
    return LossBatch(logp=logp, old_logp=old, sampler_logp=old, advantages=adv, response_mask=m)


def _loss_and_grad(cfg: StackConfig, b: LossBatch) -> tuple[torch.Tensor, torch.Tensor]:
    loss, _ = LossStack(cfg)(b)
    loss.backward()
    assert b.logp.grad is not None
    return loss.detach(), b.logp.grad


def test_ppo_at_ratio_one_is_minus_mean_advantage_with_gradient_minus_a_over_n() -> None:
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    loss, grad = _loss_and_grad(
        StackConfig(), _batch(torch.zeros(3, 5, dtype=torch.float64), adv, mask)
    )
    n = mask.sum()
    assert_close(loss, -(adv * mask).sum() / n)
    assert_close(grad, torch.where(mask, -adv / n, torch.zeros_like(adv)))


@pytest.mark.parametrize(
    ("adv", "ratio", "grad_zero"),
    [
        (1.0, 1.5, True),  # A > 0 beyond 1 + ε_high: clipped, no gradient
        (1.0, 0.5, False),  # A > 0 below 1 − ε_low: the clip is on the other side, gradient flows
        (-1.0, 0.5, True),  # A < 0 below 1 − ε_low: clipped
        (-1.0, 1.5, False),  # A < 0 above 1 + ε_high (below dual-clip c): gradient flows
    ],
)
def test_ppo_gradient_zero_only_beyond_the_clip_on_the_advantage_side(
    adv: float, ratio: float, grad_zero: bool
) -> None:
    a = torch.full((1, 1), adv, dtype=torch.float64)
    loss, grad = _loss_and_grad(StackConfig(), _batch(torch.full_like(a, math.log(ratio)), a))
    clipped_ratio = min(max(ratio, 0.8), 1.28)
    assert_close(loss, torch.tensor(max(-adv * ratio, -adv * clipped_ratio), dtype=torch.float64))
    expected = 0.0 if grad_zero else -adv * ratio  # d(−A r)/d log π = −A r
    assert_close(grad, torch.full_like(a, expected))


def test_dual_clip_bounds_loss_at_minus_c_times_advantage() -> None:
    a = torch.tensor([[-2.0, -0.5]], dtype=torch.float64)
    log_r = torch.full_like(a, math.log(100.0))  # r huge
    b = _batch(log_r, a)
    loss, m = LossStack(StackConfig())(b)
    assert_close(loss, (-3.0 * a).mean())  # c = 3
    loss.backward()
    assert b.logp.grad is not None
    assert_close(b.logp.grad, torch.zeros_like(a))
    assert_close(m["ppo_clip/dual_clip_frac"], torch.tensor(1.0, dtype=torch.float64))
    # without dual clip the loss is −A r
    loss_nodual, _ = LossStack(StackConfig(clip=ClipConfig(dual_clip_c=None)))(_batch(log_r, a))
    assert_close(loss_nodual, (-a * 100.0).mean())


def test_gspo_uses_the_sequence_ratio_and_its_gradient() -> None:
    log_r = torch.tensor([[1e-4, -2e-4, 4e-4], [0.5, 0.5, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    cfg = StackConfig(pg="gspo", aggregation="seq-mean-token-mean")
    b = _batch(log_r, adv)
    loss, grad = _loss_and_grad(cfg, b)
    s0 = math.exp(log_r[0].mean().item())  # inside [1 − 3e-4, 1 + 4e-4]
    s1 = 1 + 4e-4  # clipped on the advantage side
    assert_close(loss, torch.tensor(-(s0 + s1) / 2, dtype=torch.float64))
    expected = torch.tensor([[-s0 / 3 / 2] * 3, [0.0] * 3], dtype=torch.float64)
    assert_close(grad, expected)


def test_staleness_clip_shrinks_only_the_advantage_side_endpoint() -> None:
    drift = torch.tensor([[0.1, 0.1, -0.1, -0.1, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]])
    e_lo, e_hi = staleness_endpoints(drift, adv, 0.2, 0.28, kappa=5.0)
    f = math.exp(-0.5)
    assert_close(e_hi, torch.tensor([[0.28 * f, 0.28, 0.28, 0.28, 0.28]]))  # A>0 & s>0 only
    assert_close(e_lo, torch.tensor([[0.2, 0.2, 0.2, 0.2 * f, 0.2]]))  # A<0 & s<0 only


def test_staleness_clip_changes_the_ppo_gradient_only_on_stale_tokens() -> None:
    # A > 0, r = 1.2 (inside [0.8, 1.28]); stale token (s = 0.1) gets ε_high·e^{-0.5} ≈ 0.17
    adv = torch.ones(1, 2, dtype=torch.float64)
    log_r = torch.full_like(adv, math.log(1.2))
    old = torch.full_like(adv, -1.0)
    sampler = old - torch.tensor([[0.1, 0.0]], dtype=torch.float64)
    b = LossBatch(
        logp=(old + log_r).requires_grad_(True),
        old_logp=old,
        sampler_logp=sampler,
        advantages=adv,
        response_mask=torch.ones(1, 2, dtype=torch.bool),
    )
    cfg = StackConfig(terms=("staleness_clip",))
    loss, m = LossStack(cfg)(b)
    loss.backward()
    assert b.logp.grad is not None
    assert_close(b.logp.grad, torch.tensor([[0.0, -1.2 / 2]], dtype=torch.float64))
    assert_close(m["staleness_clip/shrunk_frac"], torch.tensor(0.5, dtype=torch.float64))
