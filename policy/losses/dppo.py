"""DPPO divergence masks (Binary-TV / Binary-KL) and the predictive top-K mask (ours).

p = π(y_t), q = μ(y_t), s = sign(A_t).

    Binary-TV: drop t if A > 0 and p − q > δ_TV, or A < 0 and p − q < −δ_TV.
    Binary-KL: D = q log(q/p) + (1−q) log((1−q)/(1−p)); drop if D > δ_KL and the update moves
               away (p > q for A > 0, p < q for A < 0).
    loss:      −A · sg(min(π/μ, C)) · M · log π  (M from the stack's token mask).

Predictive divergence mask (ours): with the sampler's top-K plus one rest bucket,
D = KL(μ‖π) over the K + 1 buckets and dD = s·[(π_a − μ_a) − Σ_j π_j(π_j − μ_j)] (the change
of D under a step along ∇ log π_a in logit space); drop if D > δ and dD > 0. With two buckets
(K = 1 holding the sampled token) D is the binary KL and dD = 2s(p − q)(1 − p): the DPPO
direction test.
"""

from __future__ import annotations

import torch
from torch import Tensor

from policy.losses.batch import LossContext
from policy.losses.config import StackConfig
from policy.losses.ops import PROB_EPS
from policy.losses.registry import Needs, TermOutput, register_term


def binary_kl(p: Tensor, q: Tensor) -> Tensor:
    """D(q‖p) of the two-bucket distributions {token, rest}; p, q probabilities (B, T)."""
    p = p.clamp(PROB_EPS, 1 - PROB_EPS)
    q = q.clamp(PROB_EPS, 1 - PROB_EPS)
    return q * (q.log() - p.log()) + (1 - q) * (torch.log1p(-q) - torch.log1p(-p))


def _moves_away(p: Tensor, q: Tensor, adv: Tensor) -> Tensor:
    return ((adv > 0) & (p > q)) | ((adv < 0) & (p < q))


def dppo_tv_keep(p: Tensor, q: Tensor, adv: Tensor, delta: float) -> Tensor:
    """(B, T) bool keep-mask of Binary-TV."""
    d = p - q
    return ~(((adv > 0) & (d > delta)) | ((adv < 0) & (d < -delta)))


def dppo_kl_keep(p: Tensor, q: Tensor, adv: Tensor, delta: float) -> Tensor:
    """(B, T) bool keep-mask of Binary-KL."""
    return ~((binary_kl(p, q) > delta) & _moves_away(p, q, adv))


def _dppo_output(ctx: LossContext, cfg: StackConfig, keep: Tensor) -> TermOutput:
    w = ctx.ratio_mu.detach().clamp(max=cfg.dppo.is_cap)  # sg(min(π/μ, C))
    loss = -ctx.adv * w * ctx.batch.logp
    maps = {"masked_frac": ~keep, "is_truncated_frac": w >= cfg.dppo.is_cap, "weight_mean": w}
    return TermOutput(loss=loss, token_mask=keep, token_metrics=maps)


@register_term("dppo_tv", kind="pg")
def dppo_tv(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """DPPO with the Binary-TV mask, δ_TV = 0.15."""
    keep = dppo_tv_keep(ctx.prob_sg, ctx.sampler_prob, ctx.adv, cfg.dppo.delta_tv)
    return _dppo_output(ctx, cfg, keep)


@register_term("dppo_kl", kind="pg")
def dppo_kl(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """DPPO with the Binary-KL mask, δ_KL = 0.05."""
    keep = dppo_kl_keep(ctx.prob_sg, ctx.sampler_prob, ctx.adv, cfg.dppo.delta_kl)
    return _dppo_output(ctx, cfg, keep)


def predictive_divergence(
    mu_topk: Tensor, pi_topk: Tensor, mu_a: Tensor, pi_a: Tensor, sign: Tensor
) -> tuple[Tensor, Tensor]:
    """(D, dD), each (B, T), from top-K probabilities (B, T, K) plus a rest bucket.

    mu_a, pi_a: (B, T) probabilities of the sampled token; sign: (B, T) sign(A).
    """
    mu_rest = (1 - mu_topk.sum(-1)).clamp_min(0)
    pi_rest = (1 - pi_topk.sum(-1)).clamp_min(0)
    mu_all = torch.cat([mu_topk, mu_rest[..., None]], -1)  # (B, T, K+1)
    pi_all = torch.cat([pi_topk, pi_rest[..., None]], -1)
    log_mu, log_pi = mu_all.clamp_min(PROB_EPS).log(), pi_all.clamp_min(PROB_EPS).log()
    div = (mu_all * (log_mu - log_pi)).sum(-1)
    d_div = sign * ((pi_a - mu_a) - (pi_all * (pi_all - mu_all)).sum(-1))
    return div, d_div


@register_term("predictive_mask", kind="modifier", needs=Needs(topk=True))
def predictive_mask(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Drop tokens whose top-K KL(μ‖π) exceeds δ and whose update would increase it."""
    b = ctx.batch
    if b.topk_logp is None or b.policy_topk_logp is None:
        raise ValueError("predictive_mask needs batch.topk_logp and batch.policy_topk_logp")
    with torch.no_grad():
        div, d_div = predictive_divergence(
            b.topk_logp.exp(), b.policy_topk_logp.detach().exp(),
            ctx.sampler_prob, ctx.prob_sg, torch.sign(ctx.adv),
        )  # fmt: skip
        keep = ~((div > cfg.dppo.predictive_delta) & (d_div > 0))
    maps = {"masked_frac": ~keep, "topk_kl_mean": div}
    return TermOutput(token_mask=keep, token_metrics=maps)
