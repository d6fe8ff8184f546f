"""Group advantages and bounded zero-sum credit shaping (docs/methods.md §2).

Read `group_advantages` first: it computes the per-rollout base advantage A_i from the
group's rewards (`base_advantages`) and the per-action shaping x_ij from a credit table
(`select_credit` → `shape_credits`); `token_advantages` then maps both onto tokens.

Shaping of one group g (G rollouts, m action slots, some padded):
    c_ij = φ_ij − mean_{valid j} φ_ij                    centre within the rollout
    y_ij = c_ij / (s_g + SCALE_EPS)                      one scale for the whole group
    x_i  = argmin ‖x − y_i‖₂  s.t. Σ_j x_ij = 0, |x_ij| ≤ κ   (`project_zero_sum_box`)
The scale s_g is ours: the population std (or mean |c|) over all valid c of the group.
Invalid (padded) actions get x = 0 and count nowhere. All functions accept leading batch
dims: rewards (..., G), credits (..., G, m), token masks (..., G, m, T).

The credit modes are the fields of `CreditTable` (`CREDIT_MODES`); `shuffled` is the placebo
(`shuffle_credits`: φ permuted within each rollout). `advantage_metrics` measures the push.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar, get_args

import torch
from torch import Tensor

from policy.losses.ops import masked_mean

Estimator = Literal["grpo", "drgrpo", "rloo"]
ShapingMode = Literal["projection", "none", "independent_clip"]
ScaleMode = Literal["std", "mean_abs"]
CreditMode = Literal["shapley", "singleton", "leave_one_out", "broadcast", "shuffled"]
V = TypeVar("V")

GRPO_STD_EPS = 1e-6
"""Added to the group's reward std so a group of equal rewards gives A = 0, not 0/0."""
SCALE_EPS = 1e-8
"""Added to s_g so a group of equal credits gives y = 0, not 0/0."""
DEFAULT_KAPPA = 2.0
"""Box bound on a shaped credit, in units of the group's credit std. Ours. With y on unit
scale, clipping at 2 binds only for outliers (a single rollout whose whole credit sits on one
of m = 5 actions reaches y = √(m−1) = 2 exactly); lopsided rollouts in an otherwise flat group
exceed it and are clipped, with the projection returning the excess to the other actions."""
DEFAULT_LAMBDA = 0.5
"""Weight of the shaping term on action tokens. Ours. λ·κ = 1 = one GRPO std unit: GRPO
advantages have unit std over the group, so a typical |A_i| ≈ 1 is never sign-flipped on any
action, and |A_i| > 1 cannot be flipped at all; only rollouts near the group mean (|A_i| < 1)
let credit decide the sign per action. Zero-sum keeps the mean over actions at A_i."""


# ---------------------------------------------------------------------------- registries


def _lookup(table: Mapping[str, V], name: str, kind: str) -> V:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid: {sorted(table)}")
    return table[name]


def _grpo(rewards: Tensor, std_eps: float = GRPO_STD_EPS) -> Tensor:
    if rewards.shape[-1] < 2:  # unbiased std undefined; a lone rollout has no signal
        return torch.zeros_like(rewards)
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, correction=1)
    return (rewards - mean) / (std + std_eps)


def _drgrpo(rewards: Tensor, std_eps: float = GRPO_STD_EPS) -> Tensor:
    return rewards - rewards.mean(dim=-1, keepdim=True)


def _rloo(rewards: Tensor, std_eps: float = GRPO_STD_EPS) -> Tensor:
    g = rewards.shape[-1]
    if g < 2:
        return torch.zeros_like(rewards)
    others_mean = (rewards.sum(dim=-1, keepdim=True) - rewards) / (g - 1)
    return rewards - others_mean


_ESTIMATORS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "grpo": _grpo,
    "drgrpo": _drgrpo,
    "rloo": _rloo,
}


def base_advantages(
    rewards: Tensor, estimator: Estimator = "grpo", std_eps: float = GRPO_STD_EPS
) -> Tensor:
    """Per-rollout advantage from the group's rewards v_i(N). rewards (..., G) → (..., G).

    grpo: (R − mean)/(std + std_eps), unbiased std (std_eps 1e-6 as verl; TRL adds 1e-4);
    drgrpo: R − mean; rloo: R_i − mean of the other G − 1 rewards. A group of one rollout gets
    0 for every estimator, and so does a group of equal rewards, exactly: the mean of G equal
    values can miss them by a rounding step (for many G: 3, 7, 8, ...), which grpo's division by
    std + std_eps would blow up to a group-wide push (float32 rewards, G = 8: up to 0.12).
    """
    out = _lookup(_ESTIMATORS, estimator, "estimator")(rewards, std_eps)
    equal = (rewards == rewards[..., :1]).all(dim=-1, keepdim=True)
    return torch.where(equal, torch.zeros_like(out), out)


# ---------------------------------------------------------------------------- credit


@dataclass(frozen=True)
class CreditTable:
    """The per-action credits of one batch, one field per credit mode, each (..., G, m), same
    shape (docs/methods.md §1, §2.2)."""

    shapley: Tensor
    """Exact Shapley value φ_ij."""
    singleton: Tensor
    """v({j}) − v(∅)."""
    leave_one_out: Tensor
    """v(N) − v(N∖{j})."""
    broadcast: Tensor
    """v(N) on every action; centring turns it into zero shaping (plain base advantage)."""
    shuffled: Tensor
    """Placebo: each rollout's φ permuted at random among its valid actions (`shuffle_credits`)."""


CREDIT_MODES: tuple[str, ...] = get_args(CreditMode)
"""The one list of credit modes (`CreditMode`); each is a field of `CreditTable`."""


def valid_permutation(action_mask: Tensor, generator: torch.Generator) -> Tensor:
    """A uniform random permutation of each rollout's valid slots, as `gather` indices.

    action_mask (..., m) bool → idx (..., m) int64: idx restricted to the valid slots is a
    bijection onto them; a padded slot j has idx j. The keys are drawn on the CPU from
    ``generator`` alone (never the global RNG), so the draw is the same on every device.
    """
    m = action_mask.shape[-1]
    keys = torch.rand(action_mask.shape, generator=generator, dtype=torch.float64)
    keys = keys.to(action_mask.device)  # (..., m) in [0, 1)
    slot = torch.arange(m, device=action_mask.device).expand_as(action_mask)
    # k-th sorted: src = the valid slots in random order, dst = in slot order; pads last in both
    src = torch.where(action_mask, keys, 2.0 + slot).argsort(dim=-1)
    dst = torch.where(action_mask, slot, m + slot).argsort(dim=-1)
    return torch.empty_like(src).scatter_(-1, dst, src)  # idx[dst[k]] = src[k]


def shuffle_credits(phi: Tensor, action_mask: Tensor, generator: torch.Generator) -> Tensor:
    """The `shuffled` placebo: φ (..., G, m) permuted within each rollout among its valid
    actions (`valid_permutation`); padded actions get 0. Same multiset of credits per rollout,
    so the same shaping magnitudes, but no information about which action earned what."""
    moved = phi.gather(-1, valid_permutation(action_mask, generator))
    return torch.where(action_mask, moved, torch.zeros_like(moved))


def select_credit(table: CreditTable | Mapping[str, Tensor], mode: CreditMode) -> Tensor:
    """The (..., G, m) credit tensor that feeds `shape_credits` under ablation `mode`."""
    if mode not in CREDIT_MODES:
        raise ValueError(f"unknown credit mode {mode!r}; valid: {sorted(CREDIT_MODES)}")
    if isinstance(table, CreditTable):
        credit: Tensor = getattr(table, mode)
        return credit
    return _lookup(table, mode, "credit mode (missing from the table)")


# ---------------------------------------------------------------------------- projection


def _clip_sum(y: Tensor, nu: Tensor, mask: Tensor, kappa: float) -> Tensor:
    """Σ_valid clip(y − ν, −κ, κ) per rollout for each candidate ν: y (..., m), ν (..., k) →
    (..., k). Nonincreasing in ν."""
    x = (y.unsqueeze(-2) - nu.unsqueeze(-1)).clamp(-kappa, kappa)  # (..., k, m)
    return torch.where(mask.unsqueeze(-2), x, 0.0).sum(dim=-1)


def _exact_nu(y: Tensor, nu: Tensor, mask: Tensor, kappa: float) -> Tensor:
    """Solve Σ = 0 for ν in closed form on the active set found at ν.

    Free F = {|y − ν| < κ}, upper U, lower L: Σ_F (y − ν) + κ(|U| − |L|) = 0. Rollouts with
    no free coordinate keep ν (then |U| = |L| and any ν in the gap is exact).
    """
    d = y - nu.unsqueeze(-1)
    free = mask & (d.abs() < kappa)
    n_up = (mask & (d >= kappa)).sum(dim=-1).to(y.dtype)  # float64: κ·count stays exact
    n_lo = (mask & (d <= -kappa)).sum(dim=-1).to(y.dtype)
    n_free = free.sum(dim=-1).to(y.dtype)
    y_free = torch.where(free, y, 0.0).sum(dim=-1)
    closed = (y_free + kappa * (n_up - n_lo)) / n_free.clamp(min=1)
    return torch.where(n_free > 0, closed, nu)


def project_zero_sum_box(y: Tensor, mask: Tensor, kappa: float) -> Tensor:
    """Euclidean projection of each rollout onto {Σ_valid x = 0, |x| ≤ κ}.

    y (..., m) float, mask (..., m) bool → x (..., m) in float64, invalid entries 0.
    x = clip(y − ν, −κ, κ) where f(ν) = Σ_valid clip(y − ν, −κ, κ) = 0. f is piecewise
    linear and nonincreasing with breakpoints y_j ± κ, so it is evaluated at all 2m
    breakpoints at once; the root lies between the last breakpoint with f ≥ 0 and the first
    with f ≤ 0, where the active set is fixed, and `_exact_nu` solves it in closed form there.
    No iteration: O(m²) work per rollout (m ≤ 8), |Σ_j x_ij| ~1e-15 · max|y|. A rollout with
    < 2 valid actions gets 0.
    """
    if kappa < 0:
        raise ValueError(f"kappa must be >= 0, got {kappa}")
    y = torch.where(mask, y.to(torch.float64), 0.0)  # (..., m)
    big = torch.finfo(torch.float64).max
    any_valid = mask.any(dim=-1, keepdim=True)
    low = torch.where(mask, y, big).amin(dim=-1, keepdim=True) - kappa  # f(low) = +nκ ≥ 0
    low = torch.where(any_valid, low, 0.0)  # (..., 1)
    # padded slots repeat the lowest breakpoint: a duplicate changes neither bracket end
    points = torch.cat([torch.where(mask, y - kappa, low), torch.where(mask, y + kappa, low)], -1)
    f = _clip_sum(y, points, mask, kappa)  # (..., 2m)
    lo = torch.where(f >= 0, points, -big).amax(dim=-1)  # exists: f(low) ≥ 0
    hi = torch.where(f <= 0, points, big).amin(dim=-1)  # exists: f(max y + κ) = −nκ ≤ 0
    hi = torch.where(any_valid.squeeze(-1), hi, 0.0)
    nu = _exact_nu(y, 0.5 * (lo + hi), mask, kappa)
    x = (y - nu.unsqueeze(-1)).clamp(-kappa, kappa)
    return torch.where(mask, x, 0.0)


# ---------------------------------------------------------------------------- shaping


def _group_scale(c: Tensor, mask: Tensor, scale: ScaleMode) -> Tensor:
    """s_g over all valid c of a group: (..., G, m) → (..., 1, 1). Population std (ours)."""
    n = mask.sum(dim=(-2, -1), keepdim=True).clamp(min=1)
    if scale == "mean_abs":
        return c.abs().sum(dim=(-2, -1), keepdim=True) / n
    if scale == "std":
        mean = c.sum(dim=(-2, -1), keepdim=True) / n  # 0 up to rounding: rows are centred
        dev = torch.where(mask, c - mean, 0.0)
        return (dev.square().sum(dim=(-2, -1), keepdim=True) / n).sqrt()
    raise ValueError(f"unknown scale {scale!r}; valid: ['mean_abs', 'std']")


def scale_credits(phi: Tensor, action_mask: Tensor, scale: ScaleMode = "std") -> Tensor:
    """Steps 1–2: y = (φ − rollout mean) / (s_g + SCALE_EPS). (..., G, m) → float64, pads 0.

    The mean is taken after shifting by the rollout's first valid φ, so a rollout of equal
    credits (e.g. the broadcast baseline) centres to exactly 0, not to rounding noise / 1e-8.
    """
    phi = phi.to(torch.float64)
    first = action_mask.to(torch.int64).argmax(dim=-1, keepdim=True)  # first valid slot
    shifted = torch.where(action_mask, phi - phi.gather(-1, first), 0.0)  # equal φ → exact 0
    n_valid = action_mask.sum(dim=-1, keepdim=True).clamp(min=1)
    c = torch.where(action_mask, shifted - shifted.sum(dim=-1, keepdim=True) / n_valid, 0.0)
    return c / (_group_scale(c, action_mask, scale) + SCALE_EPS)


_SHAPERS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "projection": project_zero_sum_box,
    "none": lambda y, mask, kappa: y,
    "independent_clip": lambda y, mask, kappa: torch.where(mask, y.clamp(-kappa, kappa), 0.0),
}


def shape_credits(
    phi: Tensor,
    action_mask: Tensor,
    kappa: float = DEFAULT_KAPPA,
    mode: ShapingMode = "projection",
    scale: ScaleMode = "std",
) -> Tensor:
    """Per-action shaping x (..., G, m) float64 from credits φ (..., G, m) of one group each.

    mode "projection": bounded zero-sum (the method); "none": centred and scaled, unbounded;
    "independent_clip": clip(y, −κ, κ) per action, NOT zero-sum (ablation; drifts).
    Padded actions (action_mask False) and rollouts with one valid action get 0.
    """
    shaper = _lookup(_SHAPERS, mode, "shaping mode")
    return shaper(scale_credits(phi, action_mask, scale), action_mask, kappa)


# ---------------------------------------------------------------------------- tokens


def token_advantages(
    base: Tensor,
    x: Tensor,
    action_token_mask: Tensor,
    response_mask: Tensor,
    lam: float = DEFAULT_LAMBDA,
) -> Tensor:
    """Token advantages (..., G, T) = response · (A_i + λ Σ_j [t ∈ action j] x_ij).

    base (..., G); x (..., G, m); action_token_mask (..., G, m, T) bool, spans disjoint
    (an overlapping token would get the sum of its actions' x); response_mask (..., G, T).
    Shared response tokens (format, separators, EOS) keep A_i; non-response tokens are 0.
    """
    dtype = torch.promote_types(base.dtype, x.dtype)
    spans = action_token_mask.to(dtype)  # (..., G, m, T)
    shaping = torch.einsum("...mt,...m->...t", spans, x.to(dtype))  # (..., G, T)
    adv = base.to(dtype).unsqueeze(-1) + lam * shaping
    return torch.where(response_mask, adv, 0.0)


# ---------------------------------------------------------------------------- entry point


@dataclass(frozen=True)
class ShapingConfig:
    """How a group's rewards and credits become advantages (docs/methods.md §2)."""

    estimator: Estimator = "grpo"
    """Base advantage over the group's v(N): grpo | drgrpo | rloo."""
    credit: CreditMode = "shapley"
    """Which credit feeds the shaping: shapley | singleton | leave_one_out | broadcast (x = 0:
    plain GRPO) | shuffled (placebo: φ permuted at random within each rollout)."""
    mode: ShapingMode = "projection"
    """projection (bounded zero-sum) | none | independent_clip (ablation, drifts)."""
    scale: ScaleMode = "std"
    """Group scale s_g: population std of the centred credits, or their mean |c|."""
    kappa: float = DEFAULT_KAPPA
    """Box bound on a shaped credit, in units of s_g."""
    lam: float = DEFAULT_LAMBDA
    """Weight of the shaping on action tokens."""
    std_eps: float = GRPO_STD_EPS
    """Added to the group's reward std by the grpo estimator: 1e-6 (CASI, verl's grpo); TRL's
    GRPOTrainer adds 1e-4 (the TRL adapter sets it so broadcast credit is TRL's advantage)."""

    def __post_init__(self) -> None:
        _lookup(_ESTIMATORS, self.estimator, "estimator")
        _lookup(_SHAPERS, self.mode, "shaping mode")
        if self.credit not in CREDIT_MODES:
            raise ValueError(f"unknown credit {self.credit!r}; valid: {sorted(CREDIT_MODES)}")
        if self.scale not in ("std", "mean_abs"):
            raise ValueError(f"unknown scale {self.scale!r}; valid: ['mean_abs', 'std']")
        if not self.kappa > 0:
            raise ValueError(f"kappa must be > 0 (box half-width in std units), got {self.kappa}")
        if not self.lam >= 0:
            raise ValueError(f"lam must be >= 0 (use 0 to disable shaping), got {self.lam}")
        if not self.std_eps > 0:
            raise ValueError(
                f"std_eps must be > 0 (a group of equal rewards divides by it), got {self.std_eps}"
            )


class GroupAdvantages(NamedTuple):
    base: Tensor
    """A_i, (..., G)."""
    x: Tensor
    """Shaped credit x_ij, (..., G, m) float64."""
    metrics: dict[str, Tensor]
    """Detached diagnostics: clip_fraction, max_abs_rollout_sum."""


def group_advantages(
    rewards: Tensor,
    credits: CreditTable | Mapping[str, Tensor],
    action_mask: Tensor,
    cfg: ShapingConfig,
) -> GroupAdvantages:
    """Base advantages from rewards v_i(N) (..., G) and shaped credits (..., G, m)."""
    base = base_advantages(rewards, cfg.estimator, cfg.std_eps)
    x = shape_credits(
        select_credit(credits, cfg.credit), action_mask, cfg.kappa, cfg.mode, cfg.scale
    )
    n_valid = action_mask.sum().clamp(min=1)
    at_bound = action_mask & (x.abs() >= cfg.kappa)
    metrics = {
        "clip_fraction": (at_bound.sum() / n_valid).detach(),
        "max_abs_rollout_sum": x.sum(dim=-1).abs().amax().detach(),
    }
    return GroupAdvantages(base=base, x=x, metrics=metrics)


def advantage_metrics(
    token_adv: Tensor,
    x: Tensor,
    action_mask: Tensor,
    action_token_mask: Tensor,
    loss_mask: Tensor,
) -> dict[str, Tensor]:
    """How hard a step pushes: detached means of |A_t| and |x| (docs/methods.md §2.2).

    token_adv (..., T), loss_mask (..., T) bool, x (..., m), action_mask (..., m) bool,
    action_token_mask (..., m, T) bool. ``adv_abs_mean``: mean |A_t| over the loss tokens;
    ``adv_abs_mean_action``: over the loss tokens inside an action span; ``shaping_abs_mean``:
    mean |x| over the valid actions (0 under broadcast). Empty masks give 0.
    """
    on_action = loss_mask & action_token_mask.any(dim=-2)  # (..., T)
    return {
        "adv_abs_mean": masked_mean(token_adv.abs(), loss_mask),
        "adv_abs_mean_action": masked_mean(token_adv.abs(), on_action),
        "shaping_abs_mean": masked_mean(x.abs(), action_mask),
    }
