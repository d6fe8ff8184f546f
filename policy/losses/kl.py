"""KL penalty to a reference policy and the dual-ascent coefficient controller.

With l = clamp(log π − log π_ref) on tokens sampled from π (all gradients w.r.t. log π):

    k1 = l                 gradient 1: E_π[∇ log π] = 0, so it does not regularise in
                           expectation (unbiased value, useless gradient as a loss).
    k2 = ½ l²              gradient l: in expectation the gradient of KL(π‖π_ref).
    k3 = e^{−l} + l − 1    gradient 1 − π_ref/π; unbiased value (E_π[π_ref/π] = 1), ≥ 0;
                           its gradient is that of KL(π_ref‖π), not of KL(π‖π_ref).
    k3_k2grad              value k3, gradient l (straight-through: k2 + sg(k3 − k2)).

`DualKLController` is the term's stateful coefficient (registered as its `controller`;
docs/methods.md §3.11): the stack weighs the term by its λ and feeds it the step's mean KL once
per rollout batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

import torch
from torch import Tensor

from policy.losses.batch import LossContext
from policy.losses.config import DualKLConfig, KLConfig, StackConfig
from policy.losses.ops import clamp_log_ratio
from policy.losses.registry import Needs, TermOutput, register_term


def _k1(l: Tensor) -> Tensor:  # noqa: E741
    return l


def _k2(l: Tensor) -> Tensor:  # noqa: E741
    return 0.5 * l * l


def _k3(l: Tensor) -> Tensor:  # noqa: E741
    return torch.exp(-l) + l - 1


def _k3_k2grad(l: Tensor) -> Tensor:  # noqa: E741
    k2 = _k2(l)
    return k2 + (_k3(l) - k2).detach()


KL_ESTIMATOR_FNS: Final[dict[str, Callable[[Tensor], Tensor]]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "k3_k2grad": _k3_k2grad,
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate (B, T) of π against π_ref (ref detached); see module docstring."""
    fn = KL_ESTIMATOR_FNS.get(estimator)
    if fn is None:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {list(KL_ESTIMATOR_FNS)}")
    return fn(clamp_log_ratio(logp - ref_logp.detach()))


def _coef(c: KLConfig) -> float:
    return c.coef


def _controller(c: KLConfig) -> DualKLController | None:
    return DualKLController(c.dual) if c.dual is not None else None


@register_term(
    "kl", kind="additive", section="kl", coefficient=_coef, controller=_controller,
    needs=Needs(reference=True), order=10,
)  # fmt: skip
def kl(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Per-token KL penalty (the stack multiplies it by λ). Needs batch.ref_logp."""
    if cfg.kl is None or ctx.batch.ref_logp is None:
        raise ValueError("the kl term needs cfg.kl and batch.ref_logp")
    loss = kl_penalty(ctx.batch.logp, ctx.batch.ref_logp, cfg.kl.estimator)
    return TermOutput(loss=loss, token_metrics={"value": loss})


class DualKLController:
    """λ ← clip(λ + η(EMA_α(min(KL, 2ε_KL)) − ε_KL), λ_min, λ_max), once per optimizer step.

    The EMA starts at the first observation. Floats only: call `update` with the step's KL
    after logging has turned metrics into numbers.
    """

    def __init__(self, cfg: DualKLConfig) -> None:
        self.cfg = cfg
        self.coef = cfg.coef_init
        self.ema: float | None = None

    def update(self, kl_value: float | Tensor) -> float:
        """Feed one step's mean KL; returns the new λ. A non-finite KL (a step that was not
        applied) changes nothing: NaN would pass min / max and hold λ at NaN for good."""
        c = self.cfg
        if not math.isfinite(float(kl_value)):
            return self.coef
        x = min(float(kl_value), 2 * c.budget)
        self.ema = x if self.ema is None else (1 - c.ema) * self.ema + c.ema * x
        self.coef = min(max(self.coef + c.lr * (self.ema - c.budget), c.coef_min), c.coef_max)
        return self.coef

    def state_dict(self) -> dict[str, float | None]:
        """Checkpointable state (for MIPU rollback and resume)."""
        return {"coef": self.coef, "ema": self.ema}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        """Restore `state_dict` output exactly."""
        coef = state["coef"]
        self.coef = float(coef) if coef is not None else self.cfg.coef_init
        self.ema = state["ema"]
