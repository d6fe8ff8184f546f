"""Paired significance of a difference between two modes measured on the same claims.

Read :func:`paired_bootstrap`. Input: per-claim values of mode A and mode B (e.g. the
seed-mean nDCG@10 of each held-out claim under Shapley and under broadcast credit). The paired
difference d_i = a_i − b_i is resampled over claims with replacement (seeded, vectorized);
the 95 % CI is the percentile interval of the resampled means, and the one-sided p-value is
the bootstrap probability that the mean difference is ≤ 0 (A is not better than B).

Ties count half: p = (#{mean* < 0} + ½ #{mean* = 0}) / B, so identical modes (every d_i = 0,
every resampled mean exactly 0) give p = 0.5 — "no evidence either way" — rather than 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PairedBootstrap", "paired_bootstrap"]

DEFAULT_RESAMPLES = 10_000
MAX_CHUNK_ELEMENTS = 1 << 22  # resample indices drawn in chunks of at most this many


@dataclass(frozen=True)
class PairedBootstrap:
    """Result of :func:`paired_bootstrap` (all differences are A − B)."""

    n: int  # claims
    mean_diff: float  # observed mean of a − b
    ci_low: float
    ci_high: float
    p_one_sided: float  # P*(mean difference ≤ 0), ties counted half
    n_resamples: int
    level: float
    seed: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "n": self.n,
            "mean_diff": self.mean_diff,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "p_one_sided": self.p_one_sided,
            "n_resamples": self.n_resamples,
            "level": self.level,
            "seed": self.seed,
        }


def _resampled_means(diff: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """(n_resamples,) means of ``diff`` resampled with replacement, drawn chunk by chunk."""
    rng = np.random.default_rng(seed)
    n = diff.size
    per_chunk = max(1, MAX_CHUNK_ELEMENTS // n)
    out = np.empty(n_resamples, dtype=np.float64)
    for start in range(0, n_resamples, per_chunk):
        rows = min(per_chunk, n_resamples - start)
        idx = rng.integers(0, n, size=(rows, n))
        out[start : start + rows] = diff[idx].mean(axis=1)
    return out


def paired_bootstrap(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = 0.95,
) -> PairedBootstrap:
    """Paired bootstrap over claims of mean(a − b): percentile CI and one-sided p.

    Args:
        a, b: per-claim values of the two modes, same length, aligned by claim (already
            averaged over seeds).
        n_resamples: bootstrap resamples (default 10,000).
        seed: the resampling seed (results are reproducible).
        level: CI level (default 0.95: the 2.5 % and 97.5 % percentiles).
    """
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape or x.size == 0:
        raise ValueError(f"a and b must be equal-length 1-D, got {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("a and b must be finite")
    if n_resamples < 1 or not 0 < level < 1:
        raise ValueError(f"need n_resamples >= 1 and 0 < level < 1, got {n_resamples}, {level}")
    diff = x - y
    means = _resampled_means(diff, n_resamples, seed)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    p = (np.count_nonzero(means < 0) + 0.5 * np.count_nonzero(means == 0)) / n_resamples
    return PairedBootstrap(
        n=int(diff.size),
        mean_diff=float(diff.mean()),
        ci_low=float(low),
        ci_high=float(high),
        p_one_sided=float(p),
        n_resamples=n_resamples,
        level=level,
        seed=seed,
    )
