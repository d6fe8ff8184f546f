"""Small numeric helpers shared by every loss term: the one log-ratio clamp, masked means,
fractions and the effective sample size. Read `clamp_log_ratio` first.

All helpers are pure functions of tensors; metric helpers return detached 0-d tensors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""Every log-ratio is clamped to ±20 before exp: exp(20) ≈ 4.9e8 is far beyond any ratio a
trust region keeps, and the clamp keeps exp, its square (DRPO/SPO quadratic terms) and
products with advantages finite in fp32/bf16 (exp overflows fp32 at ≈ 88)."""

PROB_EPS = 1e-6
"""Probabilities are kept inside [PROB_EPS, 1 − PROB_EPS] before log(1 − p) style terms:
1 − 1e-6 is still representable in fp32, so log(1 − p) stays finite."""


def clamp_log_ratio(log_ratio: Tensor) -> Tensor:
    """Clamp a log-ratio (any shape) to ±LOG_RATIO_CLAMP; the gradient is zero outside."""
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def indicator(x: Tensor) -> Tensor:
    """1[x > 0] as a float tensor, via clamp + sign (float kernels are several times faster
    than a comparison followed by a bool → float cast on CPU)."""
    return x.clamp_min(0).sign()


def outside_band(log_ratio: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """(B, T) float 1[exp(log_ratio) outside [1 − ε_low, 1 + ε_high]] (the PPO clip band)."""
    lo, hi = math.log(1 - eps_low), math.log(1 + eps_high)
    return indicator((log_ratio - (lo + hi) / 2).abs() - (hi - lo) / 2)


def masked_mean(x: Tensor, mask: Tensor, count: Tensor | None = None) -> Tensor:
    """Detached mean of x over mask (float, same shape); 0 when the mask is empty."""
    n = mask.sum() if count is None else count
    return (x.detach() * mask).sum() / n.clamp_min(1)


def fraction(cond: Tensor, mask: Tensor, count: Tensor | None = None) -> Tensor:
    """Detached share of masked entries where cond (bool) holds; 0 when the mask is empty."""
    return masked_mean(cond.to(mask.dtype), mask, count)


def seq_mean(x: Tensor, mask: Tensor, seq_len: Tensor) -> Tensor:
    """Per-sequence mean over valid tokens. x, mask: (B, T); seq_len: (B,) → (B,)."""
    return (x * mask).sum(-1) / seq_len.clamp_min(1)


def _as_map(m: Tensor, mask: Tensor) -> Tensor:
    """m detached, in mask's dtype and shape; skips no-op dispatches (they dominate at T≈256)."""
    if m.requires_grad:
        m = m.detach()
    if m.dtype != mask.dtype:
        m = m.to(mask.dtype)
    return m if m.shape == mask.shape else m.expand_as(mask)


def mean_over_tokens(maps: dict[str, Tensor], mask: Tensor, count: Tensor) -> dict[str, Tensor]:
    """Masked means of many (B, T) maps in one batched reduction (bool maps → fractions).

    Maps may broadcast against the mask (e.g. (B, 1)) and must be finite on valid tokens.
    mask: (B, T) float 0/1; count: 0-d number of valid tokens. A name ending in `weight_mean`
    with a sibling `weight_sq_mean` also gets `ess` = mean(w)² / mean(w²), the normalised
    effective sample size of those weights. Returns detached 0-d tensors.
    """
    if not maps:
        return {}
    stacked = torch.stack([_as_map(m, mask) for m in maps.values()])
    means = (stacked.view(len(maps), -1) @ mask.reshape(-1)) / count.clamp_min(1)  # (M,)
    out = dict(zip(maps, means.unbind(0), strict=True))
    for key in [k for k in out if k.endswith("weight_sq_mean")]:
        w_mean = out.get(key.removesuffix("_sq_mean") + "_mean")
        if w_mean is not None:
            out[key.removesuffix("weight_sq_mean") + "ess"] = (
                w_mean * w_mean / out[key].clamp_min(torch.finfo(count.dtype).tiny)
            )
    return out


def effective_sample_size(w: Tensor, mask: Tensor) -> Tensor:
    """Normalised ESS (Σw)² / (N·Σw²) of weights w over mask, in (0, 1]; 1 when empty."""
    wm = w.detach() * mask
    n = mask.sum().clamp_min(1)
    s1, s2 = wm.sum(), (wm * w.detach()).sum()
    ess = s1 * s1 / (n * s2.clamp_min(torch.finfo(w.dtype).tiny))
    return torch.where(s2 > 0, ess, torch.ones_like(ess))
