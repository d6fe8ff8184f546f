"""Paired significance of a difference between two modes measured on the same claims.

Read :func:`two_level_bootstrap` first (the headline test of a credit experiment), then
:func:`paired_bootstrap` (claims only), :func:`sign_flip_test` and :func:`holm`.

:func:`paired_bootstrap` takes per-claim values of mode A and mode B (e.g. the seed-mean
nDCG@10 of each held-out claim under Shapley and under broadcast credit). The paired difference
d_i = a_i − b_i is resampled over claims with replacement (seeded, vectorized); the CI is the
percentile interval of the resampled means, and the one-sided p-value is the bootstrap
probability that the mean difference is ≤ 0 (A is not better than B). It treats each seed's
trained policy as fixed, so with few seeds its interval is too narrow for a claim about the
*training method*.

:func:`two_level_bootstrap` takes (S seeds, C claims) arrays and resamples seeds, then claims
within each drawn seed, so the seed — a random effect shared by all its claims — enters the
interval; :func:`two_level_variance` is the closed form of that resampling variance.
:func:`sign_flip_test` is the exact permutation test over the S per-seed mean differences, and
:func:`holm` adjusts a family of p-values (Holm–Bonferroni step-down).

Ties count half in both bootstraps: p = (#{mean* < 0} + ½ #{mean* = 0}) / B, so identical
modes (every d = 0, every resampled mean exactly 0) give p = 0.5 — "no evidence either way" —
rather than 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "PairedBootstrap",
    "TwoLevelBootstrap",
    "holm",
    "paired_bootstrap",
    "sign_flip_equivalence",
    "sign_flip_test",
    "two_level_bootstrap",
    "two_level_variance",
]

DEFAULT_RESAMPLES = 10_000
MAX_CHUNK_ELEMENTS = 1 << 22  # resample indices drawn in chunks of at most this many
# The exact sign-flip test enumerates 2^S sums (8 MiB at S = 20); beyond that it refuses.
MAX_SIGN_FLIP_SEEDS = 20


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


@dataclass(frozen=True)
class TwoLevelBootstrap:
    """Result of :func:`two_level_bootstrap` (all differences are A − B)."""

    n_seeds: int  # S
    n_claims: int  # C
    mean_diff: float  # observed grand mean of a − b over all (seed, claim)
    ci_low: float  # percentile interval of the resampled grand means
    ci_high: float
    p_one_sided: float  # P*(grand mean ≤ 0), ties counted half
    sd: float  # bootstrap sd of the resampled grand means (ddof = 1)
    per_seed_diff: tuple[float, ...]  # (S,) mean over claims of a − b, per seed
    sign_flip_p: float | None  # :func:`sign_flip_test` of per_seed_diff; None when S > 20
    n_resamples: int
    level: float
    seed: int

    def as_dict(self) -> dict[str, float | int | list[float] | None]:
        return {
            "n_seeds": self.n_seeds,
            "n_claims": self.n_claims,
            "mean_diff": self.mean_diff,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "p_one_sided": self.p_one_sided,
            "sd": self.sd,
            "per_seed_diff": list(self.per_seed_diff),
            "sign_flip_p": self.sign_flip_p,
            "n_resamples": self.n_resamples,
            "level": self.level,
            "seed": self.seed,
        }


def _seed_claim_diff(
    a: Sequence[Sequence[float]] | np.ndarray, b: Sequence[Sequence[float]] | np.ndarray
) -> np.ndarray:
    """(S, C) float64 a − b after checking both are equal-shape, non-empty, finite 2-D."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.ndim != 2 or x.shape != y.shape or x.size == 0:
        raise ValueError(
            f"a and b must be non-empty 2-D (seeds, claims) of the same shape, got {x.shape} and {y.shape}"
        )
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("a and b must be finite")
    return x - y


def _two_level_means(diff: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """(n_resamples,) grand means of ``diff`` (S, C) under seed-then-claim resampling.

    Each resample draws S seed rows with replacement and, for each drawn row independently,
    C claims with replacement within it. Claim indices come from ``default_rng(seed)`` in the
    order :func:`_resampled_means` draws them, seed indices from a spawned child stream, so
    S = 1 reproduces :func:`paired_bootstrap` of that seed exactly.
    """
    n_seeds, n_claims = diff.shape
    claim_rng = np.random.default_rng(seed)
    seed_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])
    per_chunk = max(1, MAX_CHUNK_ELEMENTS // diff.size)
    out = np.empty(n_resamples, dtype=np.float64)
    for start in range(0, n_resamples, per_chunk):
        rows = min(per_chunk, n_resamples - start)
        claims = claim_rng.integers(0, n_claims, size=(rows, n_seeds, n_claims))  # (R, S, C)
        seeds = seed_rng.integers(0, n_seeds, size=(rows, n_seeds, 1))  # (R, S, 1)
        # balanced design: the mean of the S drawn seeds' claim means is the grand mean
        out[start : start + rows] = diff[seeds, claims].mean(axis=2).mean(axis=1)
    return out


def two_level_bootstrap(
    a: Sequence[Sequence[float]] | np.ndarray,
    b: Sequence[Sequence[float]] | np.ndarray,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = 0.95,
) -> TwoLevelBootstrap:
    """Two-level (seeds, then claims within seed) bootstrap of the grand mean of a − b.

    Args:
        a, b: (S seeds, C claims) values of the two modes, aligned by seed and by claim
            (row s of a and of b come from the runs of the two modes with seed s).
        n_resamples: bootstrap resamples (default 10,000).
        seed: the resampling seed (results are reproducible).
        level: CI level (default 0.95: the 2.5 % and 97.5 % percentiles).

    With S = 1 this is :func:`paired_bootstrap` of that seed's claims.
    """
    diff = _seed_claim_diff(a, b)  # (S, C)
    if n_resamples < 1 or not 0 < level < 1:
        raise ValueError(f"need n_resamples >= 1 and 0 < level < 1, got {n_resamples}, {level}")
    means = _two_level_means(diff, n_resamples, seed)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    p = (np.count_nonzero(means < 0) + 0.5 * np.count_nonzero(means == 0)) / n_resamples
    per_seed = diff.mean(axis=1)  # (S,)
    flip_p = sign_flip_test(per_seed) if per_seed.size <= MAX_SIGN_FLIP_SEEDS else None
    return TwoLevelBootstrap(
        n_seeds=int(diff.shape[0]),
        n_claims=int(diff.shape[1]),
        mean_diff=float(diff.mean()),
        ci_low=float(low),
        ci_high=float(high),
        p_one_sided=float(p),
        sd=float(means.std(ddof=1)) if n_resamples > 1 else 0.0,
        per_seed_diff=tuple(float(v) for v in per_seed),
        sign_flip_p=flip_p,
        n_resamples=n_resamples,
        level=level,
        seed=seed,
    )


def two_level_variance(diff: Sequence[Sequence[float]] | np.ndarray) -> float:
    """Exact variance of the two-level bootstrap grand mean of ``diff`` (S, C).

    Var* = (1/S) · [ (1/S) Σ_s (m_s − m̄)² + (1/S) Σ_s σ_s² / C ], with m_s the mean of row s,
    m̄ the grand mean and σ_s² = (1/C) Σ_c (d_sc − m_s)² (population variances: the bootstrap
    draws from the empirical distribution). It is the law of total variance for one drawn
    seed's claim mean, divided by the S independent seed draws.
    """
    d = np.asarray(diff, dtype=np.float64)
    if d.ndim != 2 or d.size == 0 or not np.isfinite(d).all():
        raise ValueError(
            f"diff must be a non-empty finite 2-D (seeds, claims) array, got {d.shape}"
        )
    n_seeds, n_claims = d.shape
    between = d.mean(axis=1).var()  # (1/S) Σ (m_s − m̄)²
    within = d.var(axis=1).mean() / n_claims  # (1/S) Σ σ_s² / C
    return float((between + within) / n_seeds)


def sign_flip_test(
    per_seed_diffs: Sequence[float] | np.ndarray, alternative: str = "greater"
) -> float:
    """Exact sign-flip test that the per-seed mean differences are centred at 0.

    Over all 2^S assignments ε ∈ {±1}^S, ``greater`` (one-sided): p = #{Σ ε_s x_s ≥ Σ x_s} / 2^S;
    ``two_sided``: p = #{|Σ ε_s x_s| ≥ |Σ x_s|} / 2^S. The identity counts, so p ≥ 2^-S; sums
    that tie with the observed one (up to a rounding bound) count as ≥, the conservative
    choice, so all-zero differences give p = 1. Refuses S > 20 (``MAX_SIGN_FLIP_SEEDS``) rather
    than fall back to sampling.
    """
    if alternative not in ("greater", "two_sided"):
        raise ValueError(f"alternative must be greater or two_sided, got {alternative!r}")
    x = np.asarray(per_seed_diffs, dtype=np.float64)
    if x.ndim != 1 or x.size == 0 or not np.isfinite(x).all():
        raise ValueError(f"per_seed_diffs must be a non-empty finite 1-D array, got {x.shape}")
    if x.size > MAX_SIGN_FLIP_SEEDS:
        raise ValueError(
            f"the exact sign-flip test enumerates 2^S sums; S = {x.size} > {MAX_SIGN_FLIP_SEEDS}"
        )
    sums = np.zeros(1, dtype=np.float64)
    for value in x:  # doubling: row 0 stays the all-plus (observed) sum, added in the same order
        sums = np.concatenate([sums + value, sums - value])  # (2^k,)
    # two S-term sums of ±x differ by rounding at most S · eps · Σ|x|
    tol = x.size * np.finfo(np.float64).eps * np.abs(x).sum()
    if alternative == "two_sided":
        sums = np.abs(sums)  # ||a| − |b|| ≤ |a − b|: the same rounding bound holds
    return float(np.count_nonzero(sums >= sums[0] - tol) / sums.size)


def sign_flip_equivalence(per_seed_diffs: Sequence[float] | np.ndarray, margin: float) -> float:
    """Two one-sided exact sign-flip tests of equivalence within ±``margin``: H0 mean ≤ −δ
    (the differences shifted by +δ, one-sided ≥) and H0 mean ≥ δ (δ minus the differences);
    p = the larger of the two."""
    x = np.asarray(per_seed_diffs, dtype=np.float64)
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    return max(sign_flip_test(x + margin), sign_flip_test(margin - x))


def holm(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm–Bonferroni adjusted p-values, keys and their order preserved.

    With p_(1) ≤ … ≤ p_(m): p̃_(i) = min(1, max_{j ≤ i} (m − j + 1) · p_(j)) — step-down,
    monotone in p, capped at 1. Rejecting p̃ ≤ α controls the family-wise error at α.
    """
    names = list(pvalues)
    p = np.asarray([pvalues[k] for k in names], dtype=np.float64)
    if not ((p >= 0) & (p <= 1)).all():  # also refuses nan
        raise ValueError(f"p-values must lie in [0, 1], got {dict(pvalues)}")
    order = np.argsort(p, kind="stable")  # (m,)
    m = p.size
    stepped = np.maximum.accumulate((m - np.arange(m)) * p[order])
    adjusted = np.empty(m, dtype=np.float64)
    adjusted[order] = np.minimum(stepped, 1.0)
    return {k: float(v) for k, v in zip(names, adjusted, strict=True)}
