"""Registry of loss terms, extended by name (after verl's `register_policy_loss`).

A term is a pure function `(ctx: LossContext, cfg: StackConfig) -> TermOutput`. Its kind says
how the stack composes it:

- "pg": the policy-gradient term; its per-token loss is what weights and masks multiply;
- "modifier": returns token weights and/or token/sequence masks for the pg loss;
- "additive": returns a per-token loss the stack adds with its coefficient (KL, entropy, critic).

A duplicate name raises ValueError; an unknown name raises KeyError listing the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

from torch import Tensor

if TYPE_CHECKING:
    from policy.losses.batch import LossContext
    from policy.losses.config import StackConfig

TermKind = Literal["pg", "modifier", "additive"]
TERM_KINDS: Final = ("pg", "modifier", "additive")


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


TermFn = Callable[["LossContext", "StackConfig"], TermOutput]


@dataclass(frozen=True)
class _Entry:
    fn: TermFn
    kind: TermKind


_REGISTRY: dict[str, _Entry] = {}


def register_term(name: str, *, kind: TermKind) -> Callable[[TermFn], TermFn]:
    """Decorator: register `fn` under `name`. Raises ValueError if the name is taken."""
    if kind not in TERM_KINDS:
        raise ValueError(f"unknown term kind {kind!r}; valid: {list(TERM_KINDS)}")

    def deco(fn: TermFn) -> TermFn:
        if name in _REGISTRY:
            raise ValueError(f"loss term {name!r} is already registered")
        _REGISTRY[name] = _Entry(fn, kind)
        return fn

    return deco


def registered_terms(kind: TermKind | None = None) -> list[str]:
    """Sorted names of registered terms, optionally of one kind."""
    return sorted(n for n, e in _REGISTRY.items() if kind is None or e.kind == kind)


def get_term(name: str, kind: TermKind | None = None) -> TermFn:
    """Look a term up by name (and check its kind). Unknown → KeyError listing valid names."""
    entry = _REGISTRY.get(name)
    if entry is None or (kind is not None and entry.kind != kind):
        what = f"{kind} term" if kind else "loss term"
        raise KeyError(f"unknown {what} {name!r}; valid: {registered_terms(kind)}")
    return entry.fn


def unregister_term(name: str) -> None:
    """Remove a term (for tests that register throw-away terms)."""
    _REGISTRY.pop(name, None)
