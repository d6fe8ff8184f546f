"""Evaluator-agreement audit: does the TRAINING evaluator's credit agree with the REFERENCE
evaluator's, size by size? (docs/methods.md §4; the statistic and the verdict rule are ours.)

Read :func:`audit` first. Inputs are two value tables scored on the SAME coalition lists
(``compute_credits(..., extra_scorers=[reference])`` gives both from one retrieval and one list
build), padded to M players, the number of real actions m_r of each rollout, and the query
(group) of each rollout. Everything else is a pure function of those tensors:

- **size-resolved marginal sign agreement**: for k = 1..M, over every (rollout r, real action
  j, S ⊆ real actions ∖ {j}, |S| = k − 1), Δ = v(S ∪ {j}) − v(S) under both evaluators; signs
  are taken with a dead zone (|Δ| ≤ tol is a tie). agree_k = share of pairs with equal signs —
  a tie in BOTH counts as agreement (docs/methods.md §4); ties are reported apart (both / training
  only / reference only), and so is the agreement among decisive pairs (no tie in either);
- **φ sign agreement** (same rule, per real action), **per-rollout Kendall τ_b** of the two φ
  vectors, **top-action agreement** (rollouts whose reference φ has a unique top action: does
  the training evaluator pick the same one, uniquely?);
- **bootstrap CIs** that resample queries (:func:`evaluator.audit_stats.bootstrap_ratio`);
- **verdict** per size: passes iff agree_k ≥ threshold; the recommended credit mode is the
  richest whose marginals all pass: ``shapley`` (every size), ``singleton`` (size 1: it reads
  only v({j}) − v(∅)), ``leave_one_out`` (v(N) − v(N ∖ {j}): each rollout's marginals of its
  own size m_r, pooled, pass), else ``none``;
- the **cost of cheap credit** (:func:`cheap_credit_by_m`): how often singleton and
  leave-one-out rank a rollout's actions differently from Shapley, by m.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

import torch
from torch import Tensor

from evaluator.audit_stats import (
    RatioCI,
    bootstrap_ratio,
    group_sums,
    kendall_tau_b,
    marginal_index,
    pair_index,
    tol_sign,
)
from evaluator.shapley import MAX_PLAYERS, exact_shapley, leave_one_out, singleton

__all__ = [
    "CREDIT_MODES",
    "AuditConfig",
    "AuditResult",
    "Games",
    "SizeAgreement",
    "audit",
    "cheap_credit_by_m",
    "leave_one_out_agreement",
    "recommend",
    "tolerance_sweep",
]

CreditMode = Literal["shapley", "singleton", "leave_one_out", "none"]
CREDIT_MODES: Final = ("shapley", "singleton", "leave_one_out", "none")
VERDICTS: Final = {
    "shapley": "agrees",
    "singleton": "partial",
    "leave_one_out": "partial",
    "none": "disagrees",
}


@dataclass(frozen=True)
class AuditConfig:
    """Knobs of the audit (ours; docs/methods.md §4 leaves them open)."""

    tol: float = 1e-3
    """|Δ| ≤ tol is a tie (both evaluators). Replay's smallest non-zero change of nDCG@10 is a
    relevant document moving from rank 9 to 10: (1/log2 10 − 1/log2 11) / IDCG ≥ 0.012 / 4.54 =
    2.6e-3, so 1e-3 never hides a replay decision, while it calls a training evaluator's
    sub-1e-3 wiggles (a list change replay does not see) ties. The report shows a sweep."""
    sweep: tuple[float, ...] = (0.0, 1e-4, 1e-3, 1e-2)
    """Tolerances of the sensitivity table (agreement by size, point estimates)."""
    threshold: float = 0.8
    """A size passes iff its sign agreement is ≥ this (random signs would agree ~0.5)."""
    n_boot: int = 1000
    """Bootstrap resamples of the queries."""
    level: float = 0.95
    """Confidence level of the percentile intervals."""
    seed: int = 0
    """Seeds the bootstrap and the scatter sample."""
    n_scatter: int = 2000
    """At most this many (Δ_train, Δ_reference) points are kept for the report's scatter."""

    def __post_init__(self) -> None:
        if self.tol < 0 or not 0.0 < self.threshold <= 1.0:
            raise ValueError(
                f"need tol ≥ 0 and 0 < threshold ≤ 1, got {self.tol}, {self.threshold}"
            )
        if self.n_boot < 1 or not 0.0 < self.level < 1.0 or self.n_scatter < 0:
            raise ValueError("need n_boot ≥ 1, 0 < level < 1 and n_scatter ≥ 0")


@dataclass(frozen=True)
class Games:
    """Two evaluators' value tables on the same coalition lists (R rollouts, M players)."""

    train: Tensor  # (R, 2^M) float64 v(S) by bitmask, training evaluator
    reference: Tensor  # (R, 2^M) float64, reference evaluator (replay)
    n_actions: Tensor  # (R,) int64 real actions m_r ≤ M (players ≥ m_r are padding)
    groups: Tensor  # (R,) int64 query of each rollout (any ids; the bootstrap unit)

    @property
    def width(self) -> int:
        return int(self.train.shape[1]).bit_length() - 1

    def validate(self) -> None:
        r, c = self.train.shape
        if self.reference.shape != (r, c) or c & (c - 1) or c < 2:
            raise ValueError(
                f"need two (R, 2^M) tables, got {self.train.shape}, {self.reference.shape}"
            )
        if not 1 <= self.width <= MAX_PLAYERS:
            raise ValueError(f"M = {self.width} players; the audit supports 1..{MAX_PLAYERS}")
        if self.n_actions.shape != (r,) or self.groups.shape != (r,) or r == 0:
            raise ValueError("n_actions and groups must be (R,) with R ≥ 1")
        if bool((self.n_actions < 0).any() | (self.n_actions > self.width).any()):
            raise ValueError(f"n_actions must lie in 0..{self.width}")


@dataclass(frozen=True)
class SizeAgreement:
    """Marginal sign agreement by coalition size k = 1..M (index k − 1); tensors (M,)."""

    agree: RatioCI  # ties in both count as agreement
    decisive: RatioCI  # agreement among pairs with no tie in either evaluator
    n_pairs: Tensor  # (M,) float64
    ties_both: Tensor  # (M,) share of pairs tied in both
    ties_train_only: Tensor  # (M,) tied in the training evaluator only
    ties_reference_only: Tensor  # (M,)
    passed: Tensor  # (M,) bool: agree ≥ threshold (False where there are no pairs)
    has_pairs: Tensor  # (M,) bool


@dataclass(frozen=True)
class AuditResult:
    """Everything the report shows; tensors on CPU, float64 (converted to floats once, later)."""

    config: AuditConfig
    n_rollouts: int
    n_queries: int
    sizes: SizeAgreement
    phi_agree: RatioCI  # (1,) sign agreement of φ over real actions
    kendall: RatioCI  # (1,) mean per-rollout τ_b (rollouts where it is defined)
    top_agree: RatioCI  # (1,) top-action agreement (rollouts with a unique reference top)
    recommended: CreditMode
    verdict: str  # agrees | partial | disagrees
    cheap_credit: dict[str, dict[int, dict[str, Tensor]]]  # evaluator → m → statistics
    sweep: dict[float, Tensor]  # tol → (M,) agreement by size at that tolerance
    scatter: dict[str, Tensor] = field(default_factory=dict)  # sampled Δ and φ pairs
    leave_one_out: RatioCI | None = None  # (1,) agreement of each rollout's own last marginals


def _real_pairs(games: Games) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Marginals of both evaluators (R, P), validity (R, P) and size (P,) of every pair."""
    idx = marginal_index(games.width)
    m = games.n_actions[:, None]  # (R, 1)
    valid = (idx.player[None, :] < m) & (idx.with_j[None, :] < (1 << m))  # S ∪ {j} ⊆ real
    d_train = games.train[:, idx.with_j] - games.train[:, idx.without]
    d_ref = games.reference[:, idx.with_j] - games.reference[:, idx.without]
    return d_train, d_ref, valid, idx.size


def _categories(d_train: Tensor, d_ref: Tensor, tol: float) -> dict[str, Tensor]:
    """Bool maps of the agreement categories of paired differences (same shape as inputs)."""
    st, sr = tol_sign(d_train, tol), tol_sign(d_ref, tol)
    return {
        "agree": st == sr,
        "tie_both": (st == 0) & (sr == 0),
        "tie_train": (st == 0) & (sr != 0),
        "tie_ref": (st != 0) & (sr == 0),
        "decisive": (st != 0) & (sr != 0),
        "decisive_agree": (st != 0) & (st == sr),
    }


@dataclass(frozen=True)
class _Resampler:
    """Per-rollout counts (R, S) → query sums → :func:`bootstrap_ratio` (one shared generator)."""

    groups: Tensor  # (R,) query index 0..Q−1
    n_groups: int
    config: AuditConfig
    gen: torch.Generator

    def sums(self, per_rollout: Tensor) -> Tensor:
        return group_sums(per_rollout, self.groups, self.n_groups)  # (Q, S)

    def ratio(self, num: Tensor, den: Tensor) -> RatioCI:
        """Σ num / Σ den with a CI; num, den (R, S) per-rollout (or (R,) for one column)."""
        num, den = (num[:, None], den[:, None]) if num.ndim == 1 else (num, den)
        return bootstrap_ratio(
            self.sums(num), self.sums(den),
            n_boot=self.config.n_boot, level=self.config.level, generator=self.gen,
        )  # fmt: skip


def size_agreement(games: Games, rs: _Resampler) -> SizeAgreement:
    """Marginal sign agreement per coalition size with query-bootstrap CIs (see module doc)."""
    d_train, d_ref, valid, size = _real_pairs(games)
    cats = _categories(d_train, d_ref, rs.config.tol)
    onehot = torch.nn.functional.one_hot(size - 1, games.width).to(torch.float64)  # (P, M)
    count = {key: (mask & valid).to(torch.float64) @ onehot for key, mask in cats.items()}
    n = valid.to(torch.float64) @ onehot  # (R, M) pairs per rollout and size
    agree = rs.ratio(count["agree"], n)
    decisive = rs.ratio(count["decisive_agree"], count["decisive"])
    total = n.sum(0)  # (M,)
    share = {key: c.sum(0) / total.clamp(min=1.0) for key, c in count.items()}
    has = total > 0
    return SizeAgreement(
        agree, decisive, total, share["tie_both"], share["tie_train"], share["tie_ref"],
        has & (agree.estimate >= rs.config.threshold), has,
    )  # fmt: skip


def _phi(games: Games) -> tuple[Tensor, Tensor, Tensor]:
    """φ of both evaluators (R, M) and the real-action mask (R, M)."""
    real = torch.arange(games.width)[None, :] < games.n_actions[:, None]
    return (
        exact_shapley(games.train, games.width),
        exact_shapley(games.reference, games.width),
        real,
    )


def _unique_top(phi: Tensor, real: Tensor, tol: float) -> tuple[Tensor, Tensor]:
    """(argmax (R,), unique (R,) bool): the top real action, and whether it beats all others by > tol."""
    masked = phi.masked_fill(~real, -torch.inf)
    if phi.shape[1] < 2:
        return masked.argmax(1), torch.zeros(phi.shape[0], dtype=torch.bool)
    top2 = masked.topk(2, dim=1)
    gap = top2.values[:, 0] - top2.values[:, 1]  # inf − (−inf) = inf when one real action
    return top2.indices[:, 0], (real.sum(1) >= 2) & (gap > tol)


def phi_agreement(games: Games, rs: _Resampler) -> tuple[RatioCI, RatioCI, RatioCI]:
    """(φ sign agreement, mean per-rollout Kendall τ_b, top-action agreement), each (1,)."""
    tol = rs.config.tol
    phi_t, phi_r, real = _phi(games)
    agree = _categories(phi_t, phi_r, tol)["agree"] & real
    sign = rs.ratio(agree.sum(1).double(), real.sum(1).double())
    tau = kendall_tau_b(phi_t, phi_r, games.n_actions, tol)  # (R,) NaN where undefined
    defined = ~tau.isnan()
    kendall = rs.ratio(torch.where(defined, tau, 0.0), defined.double())
    top_r, unique_r = _unique_top(phi_r, real, tol)
    top_t, unique_t = _unique_top(phi_t, real, tol)
    top = rs.ratio((unique_r & unique_t & (top_t == top_r)).double(), unique_r.double())
    return sign, kendall, top


def tolerance_sweep(games: Games, tols: tuple[float, ...]) -> dict[float, Tensor]:
    """Agreement by size (point estimates, (M,) each; NaN without pairs) at each tolerance."""
    d_train, d_ref, valid, size = _real_pairs(games)
    onehot = torch.nn.functional.one_hot(size - 1, games.width).to(torch.float64)  # (P, M)
    n = (valid.to(torch.float64) @ onehot).sum(0)  # (M,)
    out = {}
    for tol in tols:
        agree = _categories(d_train, d_ref, tol)["agree"] & valid
        out[tol] = torch.where(
            n > 0, (agree.to(torch.float64) @ onehot).sum(0) / n.clamp(min=1.0), torch.nan
        )
    return out


def leave_one_out_agreement(games: Games, rs: _Resampler) -> RatioCI:
    """(1,) sign agreement of the marginals leave-one-out reads, v(N) − v(N ∖ {j}): for each
    rollout those of size m_r, its own action count (size M only where every rollout has M)."""
    d_train, d_ref, valid, size = _real_pairs(games)
    last = valid & (size[None, :] == games.n_actions[:, None])  # (R, P)
    agree = _categories(d_train, d_ref, rs.config.tol)["agree"] & last
    return rs.ratio(agree.sum(1).double(), last.sum(1).double())


def recommend(passed: Tensor, has_pairs: Tensor, last_passed: bool | None = None) -> CreditMode:
    """The richest credit mode whose marginals all pass (see the module docstring).
    ``last_passed``: whether the marginals leave-one-out reads pass (`leave_one_out_agreement`:
    each rollout's own size m_r); None = those of the largest size (every rollout has M)."""
    sizes = has_pairs.nonzero().flatten()
    if sizes.numel() == 0:
        return "none"
    if bool(passed[sizes].all()):
        return "shapley"
    if bool(passed[sizes[0]]) and int(sizes[0]) == 0:
        return "singleton"
    if bool(passed[sizes[-1]]) if last_passed is None else last_passed:
        return "leave_one_out"
    return "none"


def _rank_stats(credit: Tensor, phi: Tensor, n: int, tol: float) -> dict[str, Tensor]:
    """How a cheap credit (G, n) orders n actions vs φ (G, n), over G rollouts with m = n."""
    a, b = pair_index(n)
    sc, sp = tol_sign(credit[:, a] - credit[:, b], tol), tol_sign(phi[:, a] - phi[:, b], tol)
    real = torch.ones_like(phi, dtype=torch.bool)
    top_c, uniq_c = _unique_top(credit, real, tol)
    top_p, uniq_p = _unique_top(phi, real, tol)
    return {
        "n_rollouts": torch.tensor(float(phi.shape[0]), dtype=torch.float64),
        "rank_differs": (sc != sp).any(1).double().mean(),  # any pair ordered differently
        "discordant_pairs": (sc * sp < 0).double().mean(),  # pairs in strictly opposite order
        "top_differs": ((uniq_c != uniq_p) | (uniq_p & (top_c != top_p))).double().mean(),
    }


def cheap_credit_by_m(
    values: Tensor, n_actions: Tensor, tol: float
) -> dict[int, dict[str, Tensor]]:
    """For each m ≥ 2 present: how often singleton / leave-one-out rank the actions of a
    rollout differently from Shapley (one evaluator's tables (R, 2^M)).

    Keys per m: ``n_rollouts``, then ``{singleton,leave_one_out}_{rank_differs,
    discordant_pairs,top_differs}``. "top differs": the unique top action (margin > tol)
    differs, or one credit has a unique top and the other a tie at the top.
    """
    out: dict[int, dict[str, Tensor]] = {}
    for m in sorted({int(x) for x in n_actions.tolist()}):
        if m < 2:
            continue
        table = values[n_actions == m][:, : 2**m]  # (G, 2^m): padded players are null
        phi = exact_shapley(table, m)
        row: dict[str, Tensor] = {}
        for name, credit in (
            ("singleton", singleton(table, m)),
            ("leave_one_out", leave_one_out(table, m)),
        ):
            stats = _rank_stats(credit, phi, m, tol)
            row["n_rollouts"] = stats.pop("n_rollouts")
            row.update({f"{name}_{key}": value for key, value in stats.items()})
        out[m] = row
    return out


def _scatter(games: Games, config: AuditConfig, gen: torch.Generator) -> dict[str, Tensor]:
    """A seeded sample of (Δ_train, Δ_reference, size) pairs and of (φ_train, φ_reference)."""
    d_train, d_ref, valid, size = _real_pairs(games)
    r_idx, p_idx = valid.nonzero(as_tuple=True)
    pick = torch.randperm(r_idx.numel(), generator=gen)[: config.n_scatter]
    phi_t, phi_r, real = _phi(games)
    pick_phi = torch.randperm(int(real.sum()), generator=gen)[: config.n_scatter]
    return {
        "delta_train": d_train[r_idx[pick], p_idx[pick]],
        "delta_reference": d_ref[r_idx[pick], p_idx[pick]],
        "size": size[p_idx[pick]].double(),
        "phi_train": phi_t[real][pick_phi],
        "phi_reference": phi_r[real][pick_phi],
    }


def audit(games: Games, config: AuditConfig | None = None) -> AuditResult:
    """Audit a training evaluator against a reference on the same coalition lists."""
    config = config or AuditConfig()
    games.validate()
    games = Games(
        games.train.double().cpu(),
        games.reference.double().cpu(),
        games.n_actions.long().cpu(),
        games.groups.cpu(),
    )
    _, groups = torch.unique(games.groups, return_inverse=True)
    n_groups = int(groups.max()) + 1
    gen = torch.Generator().manual_seed(config.seed)
    rs = _Resampler(groups, n_groups, config, gen)
    sizes = size_agreement(games, rs)
    phi_sign, kendall, top = phi_agreement(games, rs)
    cheap = {
        "reference": cheap_credit_by_m(games.reference, games.n_actions, config.tol),
        "train": cheap_credit_by_m(games.train, games.n_actions, config.tol),
    }
    scatter = _scatter(games, config, gen)
    loo = leave_one_out_agreement(games, rs)  # drawn last: the other intervals keep their draws
    last_passed = bool(loo.denominator[0] > 0) and bool(loo.estimate[0] >= config.threshold)
    mode = recommend(sizes.passed, sizes.has_pairs, last_passed)
    return AuditResult(
        config, games.train.shape[0], n_groups, sizes, phi_sign, kendall, top, mode,
        VERDICTS[mode], cheap, tolerance_sweep(games, config.sweep), scatter, loo,
    )  # fmt: skip
