"""Small statistics for the evaluator audit: tolerant signs, pair enumerations, Kendall τ_b,
and bootstrap confidence intervals that resample QUERIES. Pure functions of tensors.

Read :func:`bootstrap_ratio` first: every audit statistic is a ratio Σ numerator / Σ
denominator over (rollout, action, coalition) items, and the items of one query are not
independent (its G rollouts share the query, a rollout's marginals share coalitions), so the
unit resampled is the query: per-query sums (Q, S) are drawn with replacement B times.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from evaluator.shapley import coalition_sizes

__all__ = [
    "MarginalIndex",
    "RatioCI",
    "bootstrap_ratio",
    "group_sums",
    "kendall_tau_b",
    "marginal_index",
    "pair_index",
    "tol_sign",
]


def tol_sign(x: Tensor, tol: float) -> Tensor:
    """Sign with a dead zone: 0 where |x| ≤ tol, else ±1 → int64, same shape."""
    return torch.where(x.abs() <= tol, torch.zeros_like(x), torch.sign(x)).to(torch.int64)


@dataclass(frozen=True)
class MarginalIndex:
    """Every marginal v(S ∪ {j}) − v(S) of an M-player game, j ∉ S (P = M · 2^(M−1) of them)."""

    without: Tensor  # (P,) bitmask S
    with_j: Tensor  # (P,) bitmask S ∪ {j}
    player: Tensor  # (P,) j
    size: Tensor  # (P,) k = |S| + 1, in 1..M


@lru_cache(maxsize=16)
def marginal_index(n_players: int) -> MarginalIndex:
    """The (S, j) pairs of an ``n_players`` game, ordered by j then S (cached)."""
    masks = torch.arange(2**n_players, dtype=torch.int64)  # (2^M,)
    players = torch.arange(n_players, dtype=torch.int64)
    s_all, j_all = torch.meshgrid(masks, players, indexing="xy")  # (M, 2^M)
    keep = (s_all >> j_all) & 1 == 0
    s, j = s_all[keep], j_all[keep]  # (P,)
    return MarginalIndex(s, s | (1 << j), j, coalition_sizes(n_players)[s] + 1)


@lru_cache(maxsize=16)
def pair_index(n_players: int) -> tuple[Tensor, Tensor]:
    """(a, b) with a < b over ``n_players`` players → two (M(M−1)/2,) int64 tensors (cached)."""
    a, b = torch.triu_indices(n_players, n_players, offset=1)
    return a, b


def kendall_tau_b(x: Tensor, y: Tensor, n_items: Tensor, tol: float) -> Tensor:
    """Kendall τ_b between the rows of x and y (R, M), each row over its first n_items[r] items.

    Pairs whose difference is within ``tol`` are ties. τ_b = (C − D) / √((n0 − n1)(n0 − n2)),
    n0 = pairs, n1 / n2 = pairs tied in x / y. NaN where undefined (fewer than 2 items, or a
    row whose items all tie) → (R,) float64.
    """
    a, b = pair_index(x.shape[1])
    valid = (b[None, :] < n_items[:, None]).to(torch.float64)  # (R, P2); a < b < m_r
    sx = tol_sign(x[:, a] - x[:, b], tol).to(torch.float64) * valid  # (R, P2)
    sy = tol_sign(y[:, a] - y[:, b], tol).to(torch.float64) * valid
    n0 = valid.sum(-1)
    untied_x = n0 - (valid * (sx == 0)).sum(-1)
    untied_y = n0 - (valid * (sy == 0)).sum(-1)
    denom = (untied_x * untied_y).sqrt()
    return torch.where(denom > 0, (sx * sy).sum(-1) / denom.clamp(min=1.0), torch.nan)


def group_sums(values: Tensor, groups: Tensor, n_groups: int) -> Tensor:
    """Sum the rows of ``values`` (N, ...) by group id (N,) in 0..n_groups−1 → (n_groups, ...)."""
    out = torch.zeros((n_groups, *values.shape[1:]), dtype=torch.float64)
    return out.index_add_(0, groups, values.to(torch.float64))


@dataclass(frozen=True)
class RatioCI:
    """Point estimates and percentile bootstrap intervals of ratios, one per column (S,)."""

    estimate: Tensor  # (S,) Σ num / Σ den; NaN where Σ den = 0
    low: Tensor  # (S,)
    high: Tensor  # (S,)
    numerator: Tensor  # (S,) Σ num
    denominator: Tensor  # (S,) Σ den


def bootstrap_ratio(
    num: Tensor, den: Tensor, *, n_boot: int, level: float, generator: torch.Generator
) -> RatioCI:
    """Percentile CI of Σ_q num[q] / Σ_q den[q], resampling the Q queries (rows) with
    replacement ``n_boot`` times. num, den: (Q, S) per-query sums → :class:`RatioCI` of (S,).

    A resample whose denominator is 0 in a column is left out of that column's quantiles.
    """
    if num.shape != den.shape or num.ndim != 2:
        raise ValueError(f"num and den must both be (Q, S), got {num.shape} and {den.shape}")
    if not 0.0 < level < 1.0 or n_boot < 1:
        raise ValueError(f"need 0 < level < 1 and n_boot ≥ 1, got {level}, {n_boot}")
    q = num.shape[0]
    total_num, total_den = num.sum(0), den.sum(0)  # (S,)
    estimate = torch.where(total_den > 0, total_num / total_den.clamp(min=1e-300), torch.nan)
    draws = torch.randint(0, q, (n_boot, q), generator=generator)  # (B, Q)
    weights = torch.zeros(n_boot, q, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(n_boot, q, dtype=torch.float64)
    )  # (B, Q) how often each query was drawn
    b_num, b_den = weights @ num, weights @ den  # (B, S)
    ratios = torch.where(b_den > 0, b_num / b_den.clamp(min=1e-300), torch.nan)
    alpha = (1.0 - level) / 2
    qs = torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)
    bounds = torch.nanquantile(ratios, qs, dim=0)  # (2, S)
    return RatioCI(estimate, bounds[0], bounds[1], total_num, total_den)
