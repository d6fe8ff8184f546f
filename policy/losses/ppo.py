"""Clipped policy-gradient terms: PPO clip / dual-clip (token ratio) and GSPO (sequence ratio).

    PPO:  L_t = max(−A r, −A clip(r, 1−ε_low, 1+ε_high)), and for A < 0: min(L_t, −c·A),
          r = π/π_old (decoupled: the π_old/μ correction is a separate TIS weight term).
    GSPO: the same clip on s_i = exp(mean_t log π/π_old), with the GSPO-token straight-through
          s_{i,t} = sg(s_i) · π_t / sg(π_t), so per-token advantages are allowed.

Read `clipped_surrogate` first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from policy.losses.batch import LossContext
from policy.losses.config import StackConfig
from policy.losses.ops import clamp_log_ratio, masked_mean, seq_mean
from policy.losses.registry import TermOutput, register_term
from policy.losses.staleness import clip_endpoints


def clipped_surrogate(
    ratio: Tensor,
    adv: Tensor,
    eps_low: float | Tensor,
    eps_high: float | Tensor,
    dual_clip_c: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clip (+ dual-clip) per token. ratio, adv: (B, T); ε: float or (B, T).

    Returns (loss (B, T), clipped (B, T) bool, dual_clipped (B, T) bool). The gradient is zero
    where the clip binds on the advantage's side and where the dual clip binds.
    """
    surr1 = -adv * ratio
    lo, hi = 1 - eps_low, 1 + eps_high
    clipped_ratio = torch.clamp(ratio, lo, hi)  # type: ignore[arg-type]
    surr2 = -adv * clipped_ratio
    clipped = surr2 > surr1
    loss = torch.where(clipped, surr2, surr1)  # = max(surr1, surr2); where's backward is cheap
    if dual_clip_c is None:
        return loss, clipped, torch.zeros_like(clipped)
    bound = -dual_clip_c * adv
    dual = (adv < 0) & (loss > bound)
    return torch.where(dual, bound, loss), clipped, dual


@register_term("ppo_clip", kind="pg")
def ppo_clip(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """PPO clip/dual-clip on r = π/π_old (docs/methods.md §3). Defaults ε 0.2/0.28, c = 3."""
    e_lo, e_hi = clip_endpoints(ctx, cfg, cfg.clip.eps_low, cfg.clip.eps_high)
    loss, clipped, dual = clipped_surrogate(ctx.ratio, ctx.adv, e_lo, e_hi, cfg.clip.dual_clip_c)
    maps = {"clip_frac": clipped, "dual_clip_frac": dual, "ratio_mean": ctx.ratio}
    return TermOutput(loss=loss, token_metrics=maps)


@register_term("gspo", kind="pg")
def gspo(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """GSPO: sequence ratio s_i = exp(mean_t log π/π_old) clipped with the GSPO ε.

    Gradient per token: s_i · A_t · ∇log π_t where unclipped (GSPO-token form); pair it with
    aggregation 'seq-mean-token-mean' for the paper's 1/|y_i| weighting.
    """
    logp = ctx.batch.logp
    seq_lr = seq_mean(ctx.log_ratio.detach(), ctx.mask, ctx.seq_len)  # (B,)
    log_s = clamp_log_ratio(seq_lr[:, None] + logp - logp.detach())  # value sg(log s_i)
    ratio = torch.exp(log_s)  # (B, T)
    e_lo, e_hi = clip_endpoints(ctx, cfg, cfg.gspo.eps_low, cfg.gspo.eps_high)
    loss, clipped, _ = clipped_surrogate(ratio, ctx.adv, e_lo, e_hi, None)
    metrics = {"seq_ratio_mean": masked_mean(torch.exp(seq_lr), ctx.seq_valid)}
    return TermOutput(loss=loss, metrics=metrics, token_metrics={"clip_frac": clipped})
