"""Sequence masks on the mismatch ℓ_t = log π_old − log μ (flag: log π − log μ).

    GeoMean (signed baseline): keep i iff |mean_t ℓ_t| ≤ log τ.
    CARM:                      keep i iff mean_t |ℓ_t| ≤ log τ  (opposite drifts cannot cancel).

CARM guarantee (Markov): a kept sequence has at most log τ / d of its tokens outside the
clip band [1 − ε_low, 1 + ε_high], d = min(−log(1 − ε_low), log(1 + ε_high)); with the default
band [0.8, 1.28], d = log 1.25 = 0.22314, so τ = 1.02 → 8.87 %, τ = 1.04 → 17.58 %. The bound
is reported beside the measured out-of-band fraction of kept tokens.
Mode 'negative_only' masks only sequences whose mean advantage is negative (OPSM-style).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from policy.losses.batch import LossContext
from policy.losses.config import ClipConfig, StackConfig
from policy.losses.ops import indicator, seq_mean
from policy.losses.registry import TermOutput, register_term


def carm_out_of_band_bound(tau: float, clip: ClipConfig) -> float:
    """Upper bound on the out-of-band token share of a CARM-kept sequence: log τ / d."""
    d = min(-math.log(1 - clip.eps_low), math.log(1 + clip.eps_high))
    return math.log(tau) / d


@lru_cache(maxsize=64)
def _bound_tensor(tau: float, clip: ClipConfig, dtype: torch.dtype) -> Tensor:
    return torch.tensor(carm_out_of_band_bound(tau, clip), dtype=dtype)  # built once per cfg


def _mismatch(ctx: LossContext, cfg: StackConfig) -> Tensor:
    return ctx.current_mismatch_sg if cfg.seq_mask.use_current_policy else ctx.mismatch_sg


def _seq_mask_output(stat: Tensor, ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Keep-mask (B,) float 0/1 from the per-sequence statistic, and sequence-level metrics."""
    keep = stat <= math.log(cfg.seq_mask.tau)  # (B,) bool
    if cfg.seq_mask.mode == "negative_only":
        keep = keep | (ctx.seq_adv >= 0)
    keep_f = keep.to(stat.dtype)
    n_seqs = ctx.seq_valid.sum().clamp_min(1)
    kept_share, stat_mean = (torch.stack([keep_f, stat.detach()]) @ ctx.seq_valid / n_seqs).unbind()
    metrics = {"masked_seq_frac": 1 - kept_share, "stat_mean": stat_mean}
    return TermOutput(seq_mask=keep_f, metrics=metrics)


@register_term("geomean", kind="modifier")
def geomean(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Signed geometric-mean sequence mask |mean_t ℓ_t| ≤ log τ (baseline)."""
    stat = seq_mean(_mismatch(ctx, cfg), ctx.mask, ctx.seq_len).abs()
    return _seq_mask_output(stat, ctx, cfg)


@register_term("carm", kind="modifier")
def carm(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """CARM sequence mask mean_t |ℓ_t| ≤ log τ, plus its out-of-band bound vs measured share."""
    ell = _mismatch(ctx, cfg)
    out = _seq_mask_output(seq_mean(ell.abs(), ctx.mask, ctx.seq_len), ctx, cfg)
    keep = out.seq_mask
    assert keep is not None
    lo, hi = math.log(1 - cfg.clip.eps_low), math.log(1 + cfg.clip.eps_high)
    oob = indicator((ell - (lo + hi) / 2).abs() - (hi - lo) / 2)  # 1[ℓ outside [lo, hi]]
    oob_kept, n_kept = torch.stack([(oob * ctx.mask).sum(-1), ctx.seq_len]) @ keep
    out.metrics["out_of_band_frac"] = oob_kept / n_kept.clamp_min(1)
    out.metrics["out_of_band_bound"] = _bound_tensor(cfg.seq_mask.tau, cfg.clip, ctx.mask.dtype)
    return out
