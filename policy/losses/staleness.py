"""Staleness-adaptive clip endpoints (ours, docs/methods.md §3).

s_t = sg(log π_old − log μ_behaviour) measures how far the (possibly d-versions-old) behaviour
policy drifted from π_old on token t. Only the endpoint on the advantage's side shrinks:

    A > 0: ε_high,t = ε_high · exp(−κ_s · max(0, s_t))      (ε_low unchanged)
    A < 0: ε_low,t  = ε_low  · exp(−κ_s · max(0, −s_t))     (ε_high unchanged)

Both are one factor f_t = exp(−κ_s · max(0, sign(A_t)·s_t)) on the advantage-side endpoint.
`clip_endpoints` is read by the clipped pg terms; the registered term `staleness_clip` only
reports how much the endpoints shrank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from policy.losses.batch import LossContext
from policy.losses.config import StackConfig
from policy.losses.ops import indicator
from policy.losses.registry import TermOutput, register_term


def shrink_factor(drift: Tensor, adv: Tensor, kappa: float) -> Tensor:
    """(B, T) f_t = exp(−κ · max(0, sign(A_t) · s_t)) ∈ (0, 1]; 1 where A_t = 0."""
    return torch.exp(-kappa * (torch.sign(adv) * drift).clamp_min(0))


def staleness_endpoints(
    drift: Tensor, adv: Tensor, eps_low: float, eps_high: float, kappa: float
) -> tuple[Tensor, Tensor]:
    """Per-token (ε_low, ε_high), each (B, T), from drift s_t and advantages A_t (both (B, T))."""
    f = shrink_factor(drift, adv, kappa)
    one = torch.ones((), dtype=f.dtype)
    return eps_low * torch.where(adv < 0, f, one), eps_high * torch.where(adv > 0, f, one)


def _shrink(ctx: LossContext, cfg: StackConfig) -> Tensor:
    return ctx.memo(
        "staleness_shrink", lambda: shrink_factor(ctx.mismatch_sg, ctx.adv, cfg.staleness.kappa)
    )


def clip_endpoints(
    ctx: LossContext, cfg: StackConfig, eps_low: float, eps_high: float
) -> tuple[float | Tensor, float | Tensor]:
    """Clip ε for a clipped pg term: constants, or staleness-shrunk (B, T) when enabled.

    With PPO's clip only the advantage-side endpoint can bind (for A > 0 the lower clip never
    wins the max), so scaling both endpoints by f_t gives exactly the loss of
    `staleness_endpoints` with two fewer ops.
    """
    if "staleness_clip" not in cfg.terms:
        return eps_low, eps_high
    f = _shrink(ctx, cfg)
    return eps_low * f, eps_high * f


@register_term("staleness_clip", kind="modifier")
def staleness_clip(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Metrics only (the shrink itself is applied inside the pg term via `clip_endpoints`)."""
    f = _shrink(ctx, cfg)
    maps = {"shrink_mean": f, "shrunk_frac": indicator(0.99 - f)}
    metrics = {}
    if ctx.batch.versions is not None:
        metrics["versions_mean"] = ctx.batch.versions.detach().float().mean()
    return TermOutput(metrics=metrics, token_metrics=maps)
