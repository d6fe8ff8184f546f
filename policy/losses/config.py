"""Frozen, validated configuration of the loss stack (docs/methods.md §3): loss settings only
(the trainer's credit shaping and MIPU check are `policy.advantages.ShapingConfig` and
`policy.mipu.MipuConfig`, fields of `TrainConfig`). Read `StackConfig` first.

Every `__post_init__` rejects invalid values and combinations with a message that says how to
fix them. Defaults are docs/methods.md's; those marked "ours" are our choice and configurable.
`build_config` turns a TOML/JSON table into one of these dataclasses.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from policy.losses.aggregate import AGGREGATION_MODES
from policy.losses.registry import section_config

T = TypeVar("T")
KL_ESTIMATORS: Final = ("k1", "k2", "k3", "k3_k2grad")
CRITIC_KINDS: Final = ("none", "dense", "sp3o")
_CLIPPED_PG: Final = ("ppo_clip", "gspo")
_MU_RATIO_PG: Final = ("drpo", "dppo_tv", "dppo_kl")
_IS_WEIGHTS: Final = ("tis_token", "tis_seq", "icepop")


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _one_of(value: str, valid: tuple[str, ...], what: str) -> None:
    _check(value in valid, f"unknown {what} {value!r}; valid: {list(valid)}")


@dataclass(frozen=True)
class ClipConfig:
    """PPO clip / dual-clip: L = max(−A r, −A clip(r, 1−ε_low, 1+ε_high)), min(·, −cA) if A<0."""

    eps_low: float = 0.2
    """Lower clip ε_low: band starts at 1 − ε_low. In (0, 1)."""
    eps_high: float = 0.28
    """Upper clip ε_high (clip-higher): band ends at 1 + ε_high. > 0."""
    dual_clip_c: float | None = 3.0
    """Dual-clip bound c > 1 for A < 0 (loss ≤ −c·A); None disables it."""

    def __post_init__(self) -> None:
        _check(0 < self.eps_low < 1, f"clip.eps_low must be in (0, 1), got {self.eps_low}")
        _check(self.eps_high > 0, f"clip.eps_high must be > 0, got {self.eps_high}")
        c = self.dual_clip_c
        _check(c is None or c > 1, f"clip.dual_clip_c must be > 1 or None (off), got {c}")


@dataclass(frozen=True)
class GSPOConfig:
    """GSPO: clip of the sequence ratio exp(mean_t log π/π_old); the paper's tiny ε."""

    eps_low: float = 3e-4
    """Lower clip on the sequence ratio. In (0, 1)."""
    eps_high: float = 4e-4
    """Upper clip on the sequence ratio. > 0."""

    def __post_init__(self) -> None:
        _check(0 < self.eps_low < 1, f"gspo.eps_low must be in (0, 1), got {self.eps_low}")
        _check(self.eps_high > 0, f"gspo.eps_high must be > 0, got {self.eps_high}")


@dataclass(frozen=True)
class ISConfig:
    """Decoupled importance weights on ρ = π_old/μ (TIS, sequence TIS, IcePop)."""

    tis_cap: float = 2.0
    """C of token TIS: w_t = sg(min(ρ_t, C)). ≥ 1 so on-policy tokens keep weight 1."""
    tis_seq_cap: float = 2.0
    """C of sequence TIS: w_i = sg(min(exp Σ_t log ρ_t, C)). ≥ 1."""
    icepop_low: float = 0.5
    """IcePop keeps ρ·1[lo ≤ ρ ≤ hi]; lo in [0, 1] (ours, configurable)."""
    icepop_high: float = 5.0
    """IcePop upper bound hi ≥ 1 (ours, configurable)."""

    def __post_init__(self) -> None:
        _check(self.tis_cap >= 1, f"importance.tis_cap must be >= 1, got {self.tis_cap}")
        _check(
            self.tis_seq_cap >= 1, f"importance.tis_seq_cap must be >= 1, got {self.tis_seq_cap}"
        )
        lo, hi = self.icepop_low, self.icepop_high
        _check(
            0 <= lo <= 1 <= hi and lo < hi,
            f"importance.icepop_low/high must satisfy 0 <= low <= 1 <= high, got [{lo}, {hi}]",
        )


@dataclass(frozen=True)
class SeqMaskConfig:
    """GeoMean / CARM sequence masks on ℓ_t = log π_old − log μ (or log π − log μ)."""

    tau: float = 1.04
    """Threshold τ > 1: keep iff the statistic ≤ log τ (ours; 1.02–1.04 typical)."""
    mode: str = "all"
    """'all' masks any sequence; 'negative_only' only those with mean A < 0 (OPSM-style)."""
    use_current_policy: bool = False
    """Use ℓ_t = log π − log μ (current policy) instead of log π_old − log μ."""

    def __post_init__(self) -> None:
        _check(
            self.tau > 1,
            f"seq_mask.tau must be > 1 (τ <= 1 masks every sequence with any mismatch); "
            f"use e.g. 1.02 or 1.04, got {self.tau}",
        )
        _one_of(self.mode, ("all", "negative_only"), "seq_mask.mode")


@dataclass(frozen=True)
class DPPOConfig:
    """DPPO Binary-TV / Binary-KL and the predictive divergence mask (top-K)."""

    delta_tv: float = 0.15
    """Binary-TV threshold δ_TV on p − q. In (0, 1)."""
    delta_kl: float = 0.05
    """Binary-KL threshold δ_KL. > 0."""
    is_cap: float = 2.0
    """C in −A·sg(min(π/μ, C))·M·log π (ours, same as the TIS cap)."""
    predictive_delta: float = 0.05
    """Predictive mask threshold δ on the top-K KL(μ‖π) (ours: δ_KL)."""

    def __post_init__(self) -> None:
        _check(0 < self.delta_tv < 1, f"dppo.delta_tv must be in (0, 1), got {self.delta_tv}")
        _check(self.delta_kl > 0, f"dppo.delta_kl must be > 0, got {self.delta_kl}")
        _check(self.is_cap > 0, f"dppo.is_cap must be > 0, got {self.is_cap}")
        _check(self.predictive_delta > 0, "dppo.predictive_delta must be > 0")


@dataclass(frozen=True)
class DRPOConfig:
    """DRPO (r = π/μ, penalty weighted by μ_t) and SPO (r = π/π_old, no μ_t)."""

    eps: float = 12.5
    """DRPO ε (the paper's setting). > 0."""
    spo_eps: float = 0.2
    """SPO ε (the SPO paper's trust-region size). > 0."""

    def __post_init__(self) -> None:
        _check(self.eps > 0, f"drpo.eps must be > 0, got {self.eps}")
        _check(self.spo_eps > 0, f"drpo.spo_eps must be > 0, got {self.spo_eps}")


@dataclass(frozen=True)
class StalenessConfig:
    """Staleness-adaptive clip (ours): the advantage-side ε shrinks by exp(−κ_s·drift)."""

    kappa: float = 5.0
    """κ_s ≥ 0; 0 disables the shrink (ours: drift 0.1 → ×0.61)."""

    def __post_init__(self) -> None:
        _check(self.kappa >= 0, f"staleness.kappa must be >= 0, got {self.kappa}")


@dataclass(frozen=True)
class DualKLConfig:
    """Dual ascent on a KL budget: λ ← clip(λ + η(EMA_α(min(KL, 2ε)) − ε), λ_min, λ_max)."""

    budget: float = 0.01
    """KL budget ε_KL > 0 (per token, in the estimator's units)."""
    lr: float = 0.1
    """Step size η > 0."""
    ema: float = 0.1
    """EMA weight α in (0, 1] of the newest KL."""
    coef_init: float = 0.0
    """Initial λ in [coef_min, coef_max]."""
    coef_min: float = 0.0
    """Lower bound λ_min ≥ 0."""
    coef_max: float = 1.0
    """Upper bound λ_max ≥ λ_min."""

    def __post_init__(self) -> None:
        _check(self.budget > 0, f"kl.dual.budget must be > 0, got {self.budget}")
        _check(self.lr > 0, f"kl.dual.lr must be > 0, got {self.lr}")
        _check(0 < self.ema <= 1, f"kl.dual.ema must be in (0, 1], got {self.ema}")
        _check(
            0 <= self.coef_min <= self.coef_init <= self.coef_max,
            "kl.dual needs 0 <= coef_min <= coef_init <= coef_max, got "
            f"{self.coef_min}, {self.coef_init}, {self.coef_max}",
        )


@dataclass(frozen=True)
class KLConfig:
    """KL to a reference policy, added per token with coefficient λ."""

    estimator: str = "k3"
    """k1 | k2 | k3 | k3_k2grad (k3 value, k2 gradient)."""
    coef: float = 0.0
    """Fixed λ ≥ 0 (ignored when `dual` is set)."""
    dual: DualKLConfig | None = None
    """Dual-ascent controller for λ; None keeps λ fixed."""

    def __post_init__(self) -> None:
        _one_of(self.estimator, KL_ESTIMATORS, "kl.estimator")
        _check(self.coef >= 0, f"kl.coef must be >= 0, got {self.coef}")


@dataclass(frozen=True)
class CriticConfig:
    """Value loss: dense (every token) or SP3O sparse (anchor positions), value-clipped."""

    kind: str = "none"
    """none | dense | sp3o."""
    coef: float = 0.5
    """Weight of the value loss in the total loss. > 0 when kind != none."""
    value_clip: float | None = 0.2
    """Clip V − V_old to ±value_clip (needs batch.old_values); None disables."""
    anchors: tuple[float, ...] = (0.3, 0.6, 0.9)
    """SP3O anchor fractions f: positions ⌊f·L⌋ of each response (length L), plus L − 1."""
    rescale_sparse: bool = True
    """SP3O: weight anchors by L/n_anchors so the loss scale matches dense (ours)."""
    gamma: float = 1.0
    """Discount for GAE (read by the trainer)."""
    lam: float = 0.95
    """GAE λ (read by the trainer)."""

    def __post_init__(self) -> None:
        _one_of(self.kind, CRITIC_KINDS, "critic.kind")
        if self.kind != "none":
            _check(
                self.coef > 0,
                f"critic.coef must be > 0 for critic {self.kind!r}, or set kind='none'",
            )
        _check(
            self.value_clip is None or self.value_clip > 0, "critic.value_clip must be > 0 or None"
        )
        _check(
            self.kind != "sp3o" or len(self.anchors) > 0,
            "critic 'sp3o' needs at least one anchor fraction, e.g. anchors = [0.3, 0.6, 0.9]",
        )
        _check(
            all(0 <= f < 1 for f in self.anchors),
            f"critic.anchors must be in [0, 1), got {self.anchors}",
        )
        _check(
            0 <= self.gamma <= 1 and 0 <= self.lam <= 1,
            "critic.gamma and critic.lam must be in [0, 1]",
        )


@dataclass(frozen=True)
class StackConfig:
    """The whole loss stack: one policy-gradient term, weight/mask terms, additive terms."""

    pg: str = "ppo_clip"
    """Policy-gradient term: ppo_clip | gspo | dppo_tv | dppo_kl | drpo | spo."""
    terms: tuple[str, ...] = ()
    """Weight/mask terms multiplied onto the pg loss: tis_token, tis_seq, icepop, geomean,
    carm, predictive_mask, staleness_clip."""
    aggregation: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    horizon: int | None = None
    """Fixed horizon H for seq-mean-token-sum-norm (the max response length)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight β ≥ 0 (loss −β·H; needs batch.entropy when > 0)."""
    clip: ClipConfig = field(default_factory=ClipConfig)
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    importance: ISConfig = field(default_factory=ISConfig)
    seq_mask: SeqMaskConfig = field(default_factory=SeqMaskConfig)
    dppo: DPPOConfig = field(default_factory=DPPOConfig)
    drpo: DRPOConfig = field(default_factory=DRPOConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    kl: KLConfig | None = None
    """KL penalty to a reference (needs batch.ref_logp); None disables."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    sections: Mapping[str, Any] = field(default_factory=dict)
    """Config sections of additive terms registered outside this package (section name → its
    config, e.g. {"l2": L2Config(coef=0.01)}); a table given here (a preset's [sections.l2], a
    stored run) is built into the dataclass the term registered (`register_term(config=...)`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "terms", tuple(self.terms))
        object.__setattr__(self, "sections", _build_sections(self.sections))
        _one_of(self.aggregation, AGGREGATION_MODES, "aggregation")
        _check(len(set(self.terms)) == len(self.terms), f"duplicate entries in terms {self.terms}")
        _check(self.entropy_coef >= 0, f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.aggregation == "seq-mean-token-sum-norm":
            _check(
                self.horizon is not None and self.horizon > 0,
                "aggregation 'seq-mean-token-sum-norm' needs horizon > 0: set horizon to the "
                "maximum response length",
            )
        self._check_combinations()

    def __hash__(self) -> int:  # explicit: `sections` is a dict (kept hashable as a frozen config)
        values = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sections"]
        return hash((*values, tuple(sorted(self.sections.items()))))

    def section(self, name: str) -> Any:
        """A term's config section: the field `name`, else `sections[name]` (None: not set)."""
        if name in _STACK_FIELDS:
            return getattr(self, name)
        return self.sections.get(name)

    def _check_combinations(self) -> None:
        terms = set(self.terms)
        _check(
            not {"geomean", "carm"} <= terms,
            "geomean and carm are both on: keep one sequence mask ('carm' is the method, "
            "'geomean' the signed baseline it replaces)",
        )
        is_on = sorted(terms & set(_IS_WEIGHTS))
        _check(
            len(is_on) <= 1,
            f"{is_on} are all importance weights on π_old/μ: keep exactly one of them",
        )
        _check(
            self.pg not in _MU_RATIO_PG or not is_on,
            f"pg {self.pg!r} already corrects for the sampler with r = π/μ; remove {is_on} "
            "from terms (or use pg 'ppo_clip' for decoupled PPO + TIS)",
        )
        _check(
            "staleness_clip" not in terms or self.pg in _CLIPPED_PG,
            f"staleness_clip shrinks clip endpoints but pg {self.pg!r} has no clip: use pg in "
            f"{list(_CLIPPED_PG)} or remove 'staleness_clip'",
        )


_STACK_FIELDS: Final = frozenset(f.name for f in dataclasses.fields(StackConfig))


def _build_sections(sections: Mapping[str, Any]) -> dict[str, Any]:
    """`StackConfig.sections` with every table built into its term's config dataclass."""
    out: dict[str, Any] = {}
    for name, value in sections.items():
        _check(
            name not in _STACK_FIELDS,
            f"sections.{name} is a StackConfig field: set {name} = ... (or [{name}]) instead",
        )
        try:
            cls = section_config(name)
        except KeyError as err:
            raise ValueError(f"sections.{name}: {err.args[0]}") from err
        if isinstance(value, Mapping) and cls is not None:
            value = build_config(cls, dict(value), f"sections.{name}")
        out[name] = value
    return out


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass type inside a hint like `X` or `X | None`, else None."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                return arg
    return None


def build_config(cls: type[T], table: dict[str, Any], where: str) -> T:
    """Build dataclass `cls` from a TOML/JSON table, recursing into nested dataclass sections.

    Unknown keys raise ValueError naming the section and listing the valid keys; lists become
    tuples (TOML and JSON have no tuples).
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in [{where}]; valid: {names}")
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        sub = _dataclass_in(hints[key])
        if sub is not None and isinstance(value, dict):
            kwargs[key] = build_config(
                sub, value, key if where == "top level" else f"{where}.{key}"
            )
        else:
            kwargs[key] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)
