"""Registry of loss terms, extended by name (after verl's `register_policy_loss`).

A term is a pure function `(ctx: LossContext, cfg: StackConfig) -> TermOutput` (`TermFn`; the
config is typed `Any` there because `policy.losses.config` imports this module), registered
with everything the stack needs to know about it, so `LossStack` names no term. Its kind says
how the stack composes it (docs/methods.md §3.2):

- "pg": the policy-gradient term (`StackConfig.pg`); its per-token loss is what weights and
  masks multiply;
- "modifier": listed in `StackConfig.terms`; returns token weights and/or token/sequence masks
  for the pg loss;
- "additive": a per-token loss the stack adds with a coefficient (KL, entropy, critic). It
  declares its config `section` (a `StackConfig` field, or a key of `StackConfig.sections`
  for a term registered outside this package), when it is on (`enabled`), its weight
  (`coefficient`, or a stateful `controller`) and its place in the sum (`order`).

Every term declares its `needs`: the optional inputs (`Needs`) the trainer must compute for it.
A duplicate name raises ValueError; an unknown name raises KeyError listing the valid ones.
Read `register_term` first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from policy.losses.batch import LossContext

TermKind = Literal["pg", "modifier", "additive"]
TERM_KINDS: Final = ("pg", "modifier", "additive")
DEFAULT_ORDER: Final = 100
"""`order` of an additive term that does not give one: after the built-in kl, entropy, critic."""


@dataclass(frozen=True)
class TermOutput:
    """What one term returns. Every tensor is (B, T) unless noted; None means 'not used'."""

    loss: Tensor | None = None
    """(B, T) per-token loss (pg and additive terms)."""
    token_weight: Tensor | None = None
    """(B, T) detached multiplier of the pg per-token loss."""
    token_mask: Tensor | None = None
    """(B, T) keep-mask for the pg per-token loss: bool, or float 0/1."""
    seq_mask: Tensor | None = None
    """(B,) keep-mask of whole sequences for the pg loss: bool, or float 0/1."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Detached 0-d diagnostics, keyed without the term prefix (the stack adds it)."""
    token_metrics: dict[str, Tensor] = field(default_factory=dict)
    """(B, T) per-token maps (bool or float); the stack reports their mean over valid tokens,
    all terms' maps in one batched reduction (fractions: pass the bool condition)."""


@dataclass(frozen=True)
class Needs:
    """Optional inputs a term reads; the trainer computes only those the stack's terms need."""

    topk: bool = False
    """Sampler top-K log-probs and π at those ids (batch.topk_logp, batch.policy_topk_logp)."""
    entropy: bool = False
    """Per-token entropy of π with gradient (batch.entropy)."""
    values: bool = False
    """Value-head predictions, old values and returns (batch.values, old_values, returns)."""
    reference: bool = False
    """Log-probs of the frozen reference policy: a reference pass (batch.ref_logp)."""

    def __or__(self, other: Needs) -> Needs:
        return Needs(
            topk=self.topk or other.topk,
            entropy=self.entropy or other.entropy,
            values=self.values or other.values,
            reference=self.reference or other.reference,
        )


class Controller(Protocol):
    """A stateful coefficient of an additive term (e.g. the dual-ascent λ of the KL term).

    The stack weighs the term by `coef`; once per update (rollout batch) it feeds `update` the
    update's mean of the term's `value` metric (`LossStack.update_controllers`). The state is part of
    the trainer's resume state and MIPU snapshot.
    """

    @property
    def coef(self) -> float: ...

    def update(self, value: float | Tensor) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


TermFn = Callable[["LossContext", Any], TermOutput]
"""`(ctx, cfg: StackConfig) -> TermOutput`."""


def _present(section: Any) -> bool:
    return section is not None


@dataclass(frozen=True)
class Term:
    """One registered term: its function and what the stack needs to know to use it."""

    name: str
    fn: TermFn
    kind: TermKind
    needs: Needs = Needs()
    """Optional inputs the term reads."""
    section: str | None = None
    """Additive: the name of its config section (`StackConfig.section(name)`)."""
    enabled: Callable[[Any], bool] = _present
    """Additive: is the term on for this section value (default: the section is set)."""
    coefficient: Callable[[Any], float] | None = None
    """Additive: its fixed weight, read from its section."""
    controller: Callable[[Any], Controller | None] | None = None
    """Additive: builds a stateful weight from its section (None: use `coefficient`)."""
    config: type | None = None
    """Additive, registered outside `StackConfig`: the dataclass a table given for its section
    (from a preset file or a stored run) is built into."""
    order: int = DEFAULT_ORDER
    """Additive: position in the sum (ascending, then by name). Float addition is not
    associative, so the order is fixed here, not by import order."""


_REGISTRY: dict[str, Term] = {}


def register_term(
    name: str,
    *,
    kind: TermKind,
    needs: Needs = Needs(),
    section: str | None = None,
    enabled: Callable[[Any], bool] = _present,
    coefficient: Callable[[Any], float] | None = None,
    controller: Callable[[Any], Controller | None] | None = None,
    config: type | None = None,
    order: int = DEFAULT_ORDER,
) -> Callable[[TermFn], TermFn]:
    """Decorator: register `fn` under `name`. Raises ValueError if the name is taken.

    An additive term must give its `section` and `coefficient`; e.g. a term with its own
    config dataclass ``L2Config(coef: float)``, on when ``StackConfig.sections["l2"]`` is set:

        @register_term("l2", kind="additive", section="l2", config=L2Config,
                       coefficient=lambda c: c.coef)
        def l2(ctx, cfg): return TermOutput(loss=ctx.batch.logp ** 2)
    """
    if kind not in TERM_KINDS:
        raise ValueError(f"unknown term kind {kind!r}; valid: {list(TERM_KINDS)}")
    if kind == "additive" and (section is None or coefficient is None):
        raise ValueError(f"additive term {name!r} needs a config section and a coefficient")
    if kind != "additive" and (section, coefficient, controller, config) != (None,) * 4:
        raise ValueError(f"{kind} term {name!r}: only additive terms have a section/coefficient")

    def deco(fn: TermFn) -> TermFn:
        if name in _REGISTRY:
            raise ValueError(f"loss term {name!r} is already registered")
        _REGISTRY[name] = Term(
            name, fn, kind, needs, section, enabled, coefficient, controller, config, order
        )
        return fn

    return deco


def registered_terms(kind: TermKind | None = None) -> list[str]:
    """Sorted names of registered terms, optionally of one kind."""
    return sorted(n for n, e in _REGISTRY.items() if kind is None or e.kind == kind)


def term_entry(name: str, kind: TermKind | None = None) -> Term:
    """The registration of a term (and check its kind). Unknown → KeyError listing valid names."""
    entry = _REGISTRY.get(name)
    if entry is None or (kind is not None and entry.kind != kind):
        what = f"{kind} term" if kind else "loss term"
        raise KeyError(f"unknown {what} {name!r}; valid: {registered_terms(kind)}")
    return entry


def get_term(name: str, kind: TermKind | None = None) -> TermFn:
    """Look a term's function up by name (and check its kind)."""
    return term_entry(name, kind).fn


def additive_terms() -> list[Term]:
    """Every registered additive term, in the order the stack adds them."""
    terms = [e for e in _REGISTRY.values() if e.kind == "additive"]
    return sorted(terms, key=lambda e: (e.order, e.name))


def section_config(section: str) -> type | None:
    """The config dataclass an additive term registered for `section` (None: none declared).

    Raises KeyError listing the known sections when no registered term reads `section`.
    """
    owners = [e for e in _REGISTRY.values() if e.kind == "additive" and e.section == section]
    if not owners:
        known = sorted({e.section for e in additive_terms() if e.section is not None})
        raise KeyError(f"no registered additive term reads section {section!r}; known: {known}")
    return next((e.config for e in owners if e.config is not None), None)


def unregister_term(name: str) -> None:
    """Remove a term (for tests that register throw-away terms)."""
    _REGISTRY.pop(name, None)
