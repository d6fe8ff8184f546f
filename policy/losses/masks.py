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
from policy.losses.ops import outside_band, seq_mean
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


def mismatch_out_of_band(ctx: LossContext, cfg: StackConfig) -> Tensor:
    """(B, T) float 1[π_old/μ outside the clip band], computed once per call (shared)."""
    return ctx.memo(
        "mismatch_out_of_band",
        lambda: outside_band(ctx.mismatch_sg, cfg.clip.eps_low, cfg.clip.eps_high),
    )


def _seq_mask_output(
    keep: Tensor, ctx: LossContext, cfg: StackConfig, extra: Tensor | None = None
) -> tuple[TermOutput, Tensor | None]:
    """Keep-mask (B,) float 0/1 from the (B,) bool test, and the masked-sequence share.

    `extra` (B,) is summed over kept sequences and returned per kept token (one matmul).
    """
    if cfg.seq_mask.mode == "negative_only":
        keep = keep | (ctx.seq_adv >= 0)
    keep_f = keep.to(ctx.mask.dtype)
    rows = [ctx.seq_valid] if extra is None else [ctx.seq_valid, ctx.seq_len, extra]
    sums = torch.stack(rows) @ keep_f  # kept: sequences, [tokens, Σ extra]
    metrics = {"masked_seq_frac": 1 - sums[0] / ctx.n_seqs.clamp_min(1)}
    kept_extra = None if extra is None else sums[2] / sums[1].clamp_min(1)
    return TermOutput(seq_mask=keep_f, metrics=metrics), kept_extra


@register_term("geomean", kind="modifier")
def geomean(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Signed geometric-mean sequence mask |mean_t ℓ_t| ≤ log τ (baseline)."""
    stat = seq_mean(_mismatch(ctx, cfg), ctx.mask, ctx.seq_len).abs()
    return _seq_mask_output(stat <= math.log(cfg.seq_mask.tau), ctx, cfg)[0]


@register_term("carm", kind="modifier")
def carm(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """CARM sequence mask mean_t |ℓ_t| ≤ log τ, plus its out-of-band bound vs measured share.

    The measured share is over tokens of kept sequences, of the same ℓ the mask uses.
    """
    if cfg.seq_mask.use_current_policy:
        ell = ctx.current_mismatch_sg
        abs_ell, oob = ell.abs(), outside_band(ell, cfg.clip.eps_low, cfg.clip.eps_high)
    else:
        abs_ell, oob = ctx.abs_mismatch_sg, mismatch_out_of_band(ctx, cfg)
    abs_sum, oob_count = (torch.stack([abs_ell, oob]) * ctx.mask).sum(-1).unbind()  # (B,) each
    keep = abs_sum <= math.log(cfg.seq_mask.tau) * ctx.seq_len  # mean |ℓ| ≤ log τ
    out, oob_frac = _seq_mask_output(keep, ctx, cfg, extra=oob_count)
    assert oob_frac is not None
    out.metrics["out_of_band_frac"] = oob_frac
    out.metrics["out_of_band_bound"] = _bound_tensor(cfg.seq_mask.tau, cfg.clip, ctx.mask.dtype)
    return out
