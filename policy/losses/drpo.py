"""DRPO and SPO: quadratic trust-region penalties instead of a clip (docs/methods.md §3).

DRPO: L_t = −A r + |A| · μ_t · (r − 1)² / (2ε),  r = π/μ (with gradient), μ_t = sg(μ(y_t)),
      ε = 12.5. dL/dlog π = −A · r · (1 − sign(A(r − 1)) · |π − μ| / ε): the "gradient
      weight" reported as a metric. Advantages should be group-mean-centred.
SPO:  L_t = −A r + |A| · (r − 1)² / (2ε),  r = π/π_old, ε = 0.2 (no μ_t factor).
"""

from __future__ import annotations

import torch

from policy.losses.batch import LossContext
from policy.losses.config import StackConfig
from policy.losses.registry import TermOutput, register_term


@register_term("drpo", kind="pg")
def drpo(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """DRPO loss; reports the mean gradient weight and the share of reversed-sign weights."""
    r, adv, mu = ctx.ratio_mu, ctx.adv, ctx.sampler_prob
    eps = cfg.drpo.eps
    loss = -adv * r + adv.abs() * mu * (r - 1) ** 2 / (2 * eps)
    with torch.no_grad():
        weight = 1 - torch.sign(adv * (r - 1)) * (ctx.prob_sg - mu).abs() / eps
    maps = {"grad_weight_mean": weight, "reversed_frac": weight < 0, "ratio_mean": r}
    return TermOutput(loss=loss, token_metrics=maps)


@register_term("spo", kind="pg")
def spo(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """SPO loss on r = π/π_old; pairs with a TIS term for the sampler correction."""
    r, adv = ctx.ratio, ctx.adv
    loss = -adv * r + adv.abs() * (r - 1) ** 2 / (2 * cfg.drpo.spo_eps)
    eps = cfg.drpo.spo_eps
    maps = {"outside_frac": (r.detach() - 1).abs() > eps, "ratio_mean": r}
    return TermOutput(loss=loss, token_metrics=maps)
