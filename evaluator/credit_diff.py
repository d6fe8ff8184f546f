"""Where do the credits differ? Cheap credits vs exact Shapley on stored value tables.

Read :func:`credit_differences`. Given value tables v(S) of R rollouts (R × 2^M, padded players
are null players) it measures, for that set of rollouts, how much exact Shapley credit can
matter at all, before any training. Two of the questions have two readings; both are reported,
side by side:

- Do the rewrites change v? ``v_any_changes``: some coalition's value differs from v(∅) by more
  than ``tol`` (with the query as anchor, v(∅) = the query alone); where it does not, every
  credit is 0 and all modes agree trivially. ``v_full_changes``: all the rewrites together do,
  |v(N) − v(∅)| > tol (``n_gain / n_rollouts``). A rollout can change some v(S) and still have
  v(N) = v(∅), so ``v_full_changes ≤ v_any_changes``.
- Does a cheap credit order the actions differently from Shapley? For every pair j < k of a
  rollout's real actions compare sign(c_j − c_k) and sign(φ_j − φ_k), differences of at most
  ``tol`` counting as ties (sign 0). ``{singleton,leave_one_out}_rank_differs_tie_aware``: some
  pair's signs differ, so a tie on one side and a strict order on the other counts (the audit's
  ``rank_differs``, :func:`evaluator.audit.cheap_credit_by_m`).
  ``{singleton,leave_one_out}_rank_reversed_strict``: some pair is strictly reversed,
  sign(c_j − c_k) = −sign(φ_j − φ_k) ≠ 0 (the rollout-level form of the audit's
  ``discordant_pairs``). Strict ≤ tie-aware. Rollouts with fewer than 2 actions never differ;
  the fractions are over all rollouts (``n_ranked`` says how many have ≥ 2 actions).
- ``singleton_gap`` / ``leave_one_out_gap``: mean over rollouts with |v(N) − v(∅)| > tol of
  mean_j |φ_j − c_j| / |v(N) − v(∅)| (the credit's error per action, relative to the gain).
- ``interaction_mean`` / ``interaction_abs_mean``: mean (signed / absolute) pairwise Shapley
  interaction index I_jk over the real pairs of all rollouts (negative: redundant rewrites,
  positive: complementary ones; 0 for every pair of an additive game).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from evaluator.audit_stats import pair_index, tol_sign
from evaluator.shapley import (
    MAX_PLAYERS,
    exact_shapley,
    leave_one_out,
    shapley_interaction,
    singleton,
)

__all__ = ["RANK_KEYS", "CreditDifference", "credit_differences"]

DEFAULT_TOL = 1e-9
RANK_KEYS = tuple(
    f"{credit}_{rule}"
    for credit in ("singleton", "leave_one_out")
    for rule in ("rank_differs_tie_aware", "rank_reversed_strict")
)
"""The four ordering measurements (credit × definition), fractions over all rollouts."""


@dataclass(frozen=True)
class CreditDifference:
    """The measurements of :func:`credit_differences` (see the module docstring)."""

    n_rollouts: int
    n_ranked: int  # rollouts with at least 2 real actions
    n_gain: int  # rollouts with |v(N) − v(∅)| > tol (the gap's denominator)
    v_any_changes: float  # some coalition's v(S) ≠ v(∅)
    v_full_changes: float  # v(N) ≠ v(∅)
    singleton_rank_differs_tie_aware: float  # a tie vs a strict order counts
    singleton_rank_reversed_strict: float  # only strictly opposite orders count
    leave_one_out_rank_differs_tie_aware: float
    leave_one_out_rank_reversed_strict: float
    singleton_gap: float
    leave_one_out_gap: float
    interaction_mean: float
    interaction_abs_mean: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _rank_disagreement(
    credit: Tensor, phi: Tensor, n_actions: Tensor, tol: float
) -> tuple[float, float]:
    """Shares of rollouts with a real pair (j < k < m_r) ordered differently by ``credit`` and
    φ: (tie-aware: the tol-signs differ, strict: the signs are opposite and non-zero)."""
    a, b = pair_index(phi.shape[1])
    real = b[None, :] < n_actions[:, None]  # (R, P2)
    sc = tol_sign(credit[:, a] - credit[:, b], tol)  # (R, P2)
    sp = tol_sign(phi[:, a] - phi[:, b], tol)
    tie_aware = ((sc != sp) & real).any(-1)  # (R,)
    strict = ((sc * sp < 0) & real).any(-1)
    return float(tie_aware.double().mean()), float(strict.double().mean())


def _relative_gap(credit: Tensor, phi: Tensor, real: Tensor, gain: Tensor, tol: float) -> float:
    """Mean over rollouts with |gain| > tol of mean_j |φ_j − c_j| / |gain| (NaN if none)."""
    keep = gain.abs() > tol
    if not bool(keep.any()):
        return float("nan")
    per_action = (phi - credit).abs() * real  # (R, M)
    per_rollout = per_action.sum(-1) / real.sum(-1).clamp(min=1) / gain.abs().clamp(min=tol)
    return float(per_rollout[keep].mean())


def _interaction(values: Tensor, width: int, n_actions: Tensor) -> tuple[float, float]:
    a, b = pair_index(width)
    real = b[None, :] < n_actions[:, None]  # (R, P2)
    if width < 2 or not bool(real.any()):
        return float("nan"), float("nan")
    pairs = shapley_interaction(values, width)[:, a, b][real]  # (n real pairs,)
    return float(pairs.mean()), float(pairs.abs().mean())


def credit_differences(
    values: Tensor, n_actions: Tensor, *, tol: float = DEFAULT_TOL
) -> CreditDifference:
    """Cheap credits vs Shapley on R value tables (one environment's rollouts).

    Args:
        values: ``(R, 2**M)`` v(S) by coalition bitmask (bit j = action j); actions
            ``j ≥ n_actions[r]`` must be null players (as :func:`evaluator.credit.compute_credits`
            pads them).
        n_actions: ``(R,)`` real actions per rollout, 0..M.
        tol: differences of at most this count as ties / as "no change".
    """
    if values.ndim != 2 or values.shape[0] != n_actions.shape[0] or values.shape[0] == 0:
        raise ValueError(f"values (R, 2^M) and n_actions (R,), R ≥ 1; got {tuple(values.shape)}")
    width = int(values.shape[1]).bit_length() - 1
    if 2**width != values.shape[1] or not 1 <= width <= MAX_PLAYERS:
        raise ValueError(f"values must have 2^M columns, 1 ≤ M ≤ {MAX_PLAYERS}")
    table = values.to(torch.float64)
    counts = n_actions.to(torch.int64)
    real = (torch.arange(width)[None, :] < counts[:, None]).to(torch.float64)  # (R, M)
    phi = exact_shapley(table, width) * real
    solo, loo = singleton(table, width) * real, leave_one_out(table, width) * real
    gain = table[:, -1] - table[:, 0]
    inter_mean, inter_abs = _interaction(table, width, counts)
    solo_tie, solo_strict = _rank_disagreement(solo, phi, counts, tol)
    loo_tie, loo_strict = _rank_disagreement(loo, phi, counts, tol)
    return CreditDifference(
        n_rollouts=int(table.shape[0]),
        n_ranked=int((counts >= 2).sum()),
        n_gain=int((gain.abs() > tol).sum()),
        v_any_changes=float(((table - table[:, :1]).abs() > tol).any(-1).double().mean()),
        v_full_changes=float((gain.abs() > tol).double().mean()),
        singleton_rank_differs_tie_aware=solo_tie,
        singleton_rank_reversed_strict=solo_strict,
        leave_one_out_rank_differs_tie_aware=loo_tie,
        leave_one_out_rank_reversed_strict=loo_strict,
        singleton_gap=_relative_gap(solo, phi, real, gain, tol),
        leave_one_out_gap=_relative_gap(loo, phi, real, gain, tol),
        interaction_mean=inter_mean,
        interaction_abs_mean=inter_abs,
    )
