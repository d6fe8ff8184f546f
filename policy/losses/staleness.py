"""Staleness-adaptive clip endpoints (ours, METHODS.md §3).

s_t = sg(log π_old − log μ_behaviour) measures how far the (possibly d-versions-old) behaviour
policy drifted from π_old on token t. Only the endpoint on the advantage's side shrinks:

    A > 0: ε_high,t = ε_high · exp(−κ_s · max(0, s_t))      (ε_low unchanged)
    A < 0: ε_low,t  = ε_low  · exp(−κ_s · max(0, −s_t))     (ε_high unchanged)

`clip_endpoints` is read by the clipped pg terms; the registered term `staleness_clip` only
reports how much the endpoints shrank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from policy.losses.batch import LossContext
from policy.losses.config import StackConfig
from policy.losses.ops import fraction, masked_mean
from policy.losses.registry import TermOutput, register_term


def staleness_endpoints(
    drift: Tensor, adv: Tensor, eps_low: float, eps_high: float, kappa: float
) -> tuple[Tensor, Tensor]:
    """Per-token (ε_low, ε_high), each (B, T), from drift s_t and advantages A_t (both (B, T))."""
    shrink_hi = torch.exp(-kappa * drift.clamp_min(0))
    shrink_lo = torch.exp(-kappa * (-drift).clamp_min(0))
    one = torch.ones((), dtype=drift.dtype)
    e_hi = eps_high * torch.where(adv > 0, shrink_hi, one)
    e_lo = eps_low * torch.where(adv < 0, shrink_lo, one)
    return e_lo, e_hi


def clip_endpoints(
    ctx: LossContext, cfg: StackConfig, eps_low: float, eps_high: float
) -> tuple[float | Tensor, float | Tensor]:
    """Clip ε for a clipped pg term: constants, or staleness-shrunk (B, T) when enabled."""
    if "staleness_clip" not in cfg.terms:
        return eps_low, eps_high
    return staleness_endpoints(ctx.mismatch_sg, ctx.adv, eps_low, eps_high, cfg.staleness.kappa)


@register_term("staleness_clip", kind="modifier")
def staleness_clip(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Metrics only (the shrink itself is applied inside the pg term via `clip_endpoints`)."""
    base = (
        (cfg.gspo.eps_low, cfg.gspo.eps_high)
        if cfg.pg == "gspo"
        else (
            cfg.clip.eps_low,
            cfg.clip.eps_high,
        )
    )
    e_lo, e_hi = clip_endpoints(ctx, cfg, *base)
    assert isinstance(e_lo, Tensor) and isinstance(e_hi, Tensor)
    shrink = (e_lo / base[0]) * (e_hi / base[1])  # one factor is 1 on every token
    metrics = {
        "shrink_mean": masked_mean(shrink, ctx.mask, ctx.n_tokens),
        "shrunk_frac": fraction(shrink < 0.99, ctx.mask, ctx.n_tokens),
    }
    if ctx.batch.versions is not None:
        metrics["versions_mean"] = ctx.batch.versions.detach().float().mean()
    return TermOutput(metrics=metrics)
