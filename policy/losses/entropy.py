"""Entropy bonus: per-token loss −H_t (the stack multiplies it by `entropy_coef`)."""

from __future__ import annotations

from policy.losses.batch import LossContext
from policy.losses.config import StackConfig
from policy.losses.registry import Needs, TermOutput, register_term


def _on(entropy_coef: float) -> bool:
    return entropy_coef > 0


def _coef(entropy_coef: float) -> float:
    return entropy_coef


@register_term(
    "entropy", kind="additive", section="entropy_coef", enabled=_on, coefficient=_coef,
    needs=Needs(entropy=True), order=20,
)  # fmt: skip
def entropy_bonus(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """−H_t per token; needs batch.entropy (B, T) with gradient."""
    ent = ctx.batch.entropy
    if ent is None:
        raise ValueError("entropy_coef > 0 needs batch.entropy (B, T); or set entropy_coef = 0")
    return TermOutput(loss=-ent, token_metrics={"mean": ent})
