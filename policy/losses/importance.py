"""Decoupled importance weights on ρ_t = π_old/μ (docs/methods.md §3, MIPU step 1).

    tis_token: w_t = sg(min(ρ_t, C))                         C = 2
    tis_seq:   w_i = sg(min(exp Σ_t log ρ_t, C))             broadcast to the sequence's tokens
    icepop:    w_t = sg(ρ_t · 1[lo ≤ ρ_t ≤ hi])

Each multiplies the pg per-token loss (r = π/π_old there), never carries a gradient, and
reports the truncated/masked fraction and the ESS of its weights.
"""

from __future__ import annotations

import torch

from policy.losses.batch import LossContext
from policy.losses.config import StackConfig
from policy.losses.ops import (
    clamp_log_ratio,
    effective_sample_size,
    fraction,
    masked_mean,
)
from policy.losses.registry import TermOutput, register_term


@register_term("tis_token", kind="modifier")
def tis_token(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Token-level truncated IS weight min(π_old/μ, C), detached."""
    rho = ctx.is_ratio_sg
    w = rho.clamp(max=cfg.importance.tis_cap)
    maps = {
        "truncated_frac": torch.sign(rho - w),  # 1 where ρ > C, as ρ − w = relu(ρ − C)
        "weight_mean": w,
        "weight_sq_mean": w * w,
    }
    return TermOutput(token_weight=w, token_metrics=maps)  # the stack derives `ess`


@register_term("tis_seq", kind="modifier")
def tis_seq(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Sequence-level truncated IS weight min(exp Σ_t log ρ_t, C), detached, per sequence."""
    log_w = clamp_log_ratio((ctx.mismatch_sg * ctx.mask).sum(-1))  # (B,)
    cap = cfg.importance.tis_seq_cap
    w_seq = torch.exp(log_w).clamp(max=cap)
    metrics = {
        "truncated_frac": fraction(log_w > torch.log(torch.tensor(cap)), ctx.seq_valid),
        "weight_mean": masked_mean(w_seq, ctx.seq_valid),
        "ess": effective_sample_size(w_seq, ctx.seq_valid),
    }
    return TermOutput(token_weight=w_seq[:, None].expand_as(ctx.mask), metrics=metrics)


@register_term("icepop", kind="modifier")
def icepop(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """IcePop: ρ_t kept inside [lo, hi], zero outside (the token is dropped), detached."""
    rho = ctx.is_ratio_sg
    inside = (rho >= cfg.importance.icepop_low) & (rho <= cfg.importance.icepop_high)
    w = torch.where(inside, rho, torch.zeros((), dtype=rho.dtype))
    maps = {"masked_frac": ~inside, "weight_mean": w, "weight_sq_mean": w * w}
    return TermOutput(token_weight=w, token_metrics=maps)  # the stack derives `ess`
