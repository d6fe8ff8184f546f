"""The loss stack: one pg term × weights × masks, plus additive terms, aggregated ONCE.

    loss_tok = pg_loss_t · Π_k w_k,t · Π_k keep_k,t      (one detached factor)
               + Σ_a c_a · additive_a,t                  (λ_KL·kl_t − β·H_t + c_V·critic_t)
    loss     = aggregate(loss_tok, response_mask, mode, global_tokens, global_seqs, horizon)

Read `LossStack.__call__` first. Every term comes from the registry (`policy.losses.registry`)
with what it declared when it registered: pg and modifier terms by name from the config, the
additive terms that are on for their config section, each with its coefficient (or stateful
controller), its place in the sum and the inputs it needs. The stack names no term
(docs/methods.md §3.2); shared quantities are computed once in `LossContext`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from policy.losses.aggregate import aggregate
from policy.losses.batch import LossBatch, LossContext
from policy.losses.config import StackConfig
from policy.losses.masks import mismatch_out_of_band
from policy.losses.ops import mean_over_tokens
from policy.losses.registry import (
    Controller,
    Needs,
    Term,
    TermFn,
    TermOutput,
    additive_terms,
    term_entry,
)

Metrics = dict[str, Tensor]


class LossStack:
    """Build once from a `StackConfig`; call on each micro-batch: `loss, metrics = stack(b)`.

    `controllers` holds the stateful coefficients (e.g. the KL term's dual-ascent λ when
    cfg.kl.dual is set); `policy.update.policy_update` calls `stack.update_controllers(metrics)`
    once per update with its metrics (token-weighted means over the micro-batches), and the
    trainer keeps `state_dict()` in its resume state.
    """

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        pg = term_entry(cfg.pg, "pg")
        self._pg = pg.fn
        modifiers = [term_entry(name, "modifier") for name in cfg.terms]
        self._modifiers = [(e.name, e.fn) for e in modifiers]
        on = [e for e in additive_terms() if e.enabled(cfg.section(_section(e)))]
        self._additive = [(e.name, e.fn) for e in on]
        self._weights = {e.name: e for e in on}
        self.controllers: dict[str, Controller] = {}
        for e in on:
            ctrl = e.controller(cfg.section(_section(e))) if e.controller is not None else None
            if ctrl is not None:
                self.controllers[e.name] = ctrl
        self._needs = [(e.name, e.needs) for e in (pg, *modifiers, *on)]
        self.needs: Needs = functools.reduce(lambda a, b: a | b, (n for _, n in self._needs))
        """What a `LossBatch` must carry for this configuration (the union of its terms')."""

    def coefficient(self, name: str) -> float:
        """Current weight of an additive term (a controller's, e.g. a dual λ_KL, may move)."""
        ctrl = self.controllers.get(name)
        if ctrl is not None:
            return ctrl.coef
        entry = self._weights[name]
        assert entry.coefficient is not None  # register_term requires it for additive terms
        return entry.coefficient(self.cfg.section(_section(entry)))

    def update_controllers(self, metrics: Mapping[str, Tensor]) -> None:
        """Once per update: feed each controller the update's mean of its term's `value` metric."""
        for name, ctrl in self.controllers.items():
            key = f"{name}/value"
            if key in metrics:
                ctrl.update(float(metrics[key]))

    def state_dict(self) -> dict[str, Any]:
        """The controllers' state by term name (resume state, MIPU snapshot)."""
        return {name: ctrl.state_dict() for name, ctrl in self.controllers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output exactly (terms without a stored state keep theirs)."""
        for name, ctrl in self.controllers.items():
            if state.get(name) is not None:
                ctrl.load_state_dict(state[name])

    def __call__(self, batch: LossBatch) -> tuple[Tensor, Metrics]:
        """Total loss (0-d, differentiable) and detached 0-d metrics keyed 'term/metric'."""
        check_batch(batch, self._needs)
        ctx = LossContext(batch)
        metrics: Metrics = {}
        maps: Metrics = {}  # per-token maps, reduced once at the end
        pg_out = _run(self.cfg.pg, self._pg, ctx, self.cfg, metrics, maps)
        assert pg_out.loss is not None, f"pg term {self.cfg.pg!r} returned no loss"
        factor, keep = self._modifier_outputs(pg_out, ctx, metrics, maps)  # detached
        total = pg_out.loss if factor is None else pg_out.loss * factor
        for name, fn in self._additive:
            out = _run(name, fn, ctx, self.cfg, metrics, maps)
            assert out.loss is not None, f"additive term {name!r} returned no loss"
            total = total + self.coefficient(name) * out.loss
        loss = aggregate(
            total,
            ctx.valid,
            self.cfg.aggregation,
            ctx.n_tokens if batch.global_tokens is None else batch.global_tokens,
            ctx.n_seqs if batch.global_seqs is None else batch.global_seqs,
            self.cfg.horizon,
            batch.dp_world_size,
        )
        metrics.update(_shared_metrics(ctx, self.cfg, keep, maps))
        return loss, metrics

    def _modifier_outputs(
        self, pg_out: TermOutput, ctx: LossContext, metrics: Metrics, maps: Metrics
    ) -> tuple[Tensor | None, Tensor | None]:
        """(weights × 0/1 masks, 0/1 masks alone) over the pg term and modifiers, detached.

        Each is None when no term contributed; masks may be (B, 1) (sequence masks only).
        """
        factor, keep = _merge(None, None, pg_out, ctx)
        for name, fn in self._modifiers:
            out = _run(name, fn, ctx, self.cfg, metrics, maps)
            factor, keep = _merge(factor, keep, out, ctx)
        return factor, keep


def _run(
    name: str, fn: TermFn, ctx: LossContext, cfg: StackConfig, metrics: Metrics, maps: Metrics
) -> TermOutput:
    out = fn(ctx, cfg)
    metrics.update({f"{name}/{k}": v.detach() for k, v in out.metrics.items()})
    maps.update({f"{name}/{k}": v for k, v in out.token_metrics.items()})
    return out


def _merge(
    factor: Tensor | None, keep: Tensor | None, out: TermOutput, ctx: LossContext
) -> tuple[Tensor | None, Tensor | None]:
    dtype = ctx.mask.dtype
    seq = None if out.seq_mask is None else out.seq_mask[:, None]
    for part, is_mask in ((out.token_weight, False), (out.token_mask, True), (seq, True)):
        if part is not None:
            p = part.detach() if part.requires_grad else part
            p = p if p.dtype == dtype else p.to(dtype)
            factor = p if factor is None else factor * p
            if is_mask:
                keep = p if keep is None else keep * p
    return factor, keep


def _shared_metrics(
    ctx: LossContext, cfg: StackConfig, keep: Tensor | None, maps: Metrics
) -> Metrics:
    """All per-token maps reduced at once, plus the π_old-vs-μ mismatch and survivors."""
    ell = ctx.mismatch_sg
    maps["mismatch/log_ratio_mean"] = ell  # mean of log π_old − log μ; KL(μ‖π_old) ≈ −this
    maps["mismatch/abs_log_ratio_mean"] = ctx.abs_mismatch_sg  # global CARM statistic
    maps["mismatch/kl_k3"] = ctx.is_ratio_sg - 1 - ell  # k3 estimate of KL(μ‖π_old), ≥ 0
    maps["mismatch/out_of_band_frac"] = mismatch_out_of_band(ctx, cfg)  # π_old/μ outside clip band
    n = ctx.n_tokens
    if keep is None:
        kept = (n > 0).to(ctx.mask.dtype)
    elif keep.shape[-1] == 1:  # sequence masks only: (B,) arithmetic
        kept = (keep[:, 0] @ ctx.seq_len) / n.clamp_min(1)
    else:
        maps["stack/kept_frac"] = keep
    out = mean_over_tokens(maps, ctx.mask, n)
    if keep is None or keep.shape[-1] == 1:
        out["stack/kept_frac"] = kept
    out["stack/n_tokens"] = n.detach()
    out["stack/fully_masked"] = (out["stack/kept_frac"] == 0).to(ctx.mask.dtype)
    return out


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def check_batch(batch: LossBatch, needs: list[tuple[str, Needs]]) -> None:
    """Shapes agree and every tensor the configured terms need is present (says how to fix)."""
    shape = batch.logp.shape
    _need(len(shape) == 2, f"batch.logp must be (B, T), got {tuple(shape)}")
    for name in ("old_logp", "sampler_logp", "advantages", "response_mask", "ref_logp",
                 "values", "old_values", "returns", "entropy"):  # fmt: skip
        t = getattr(batch, name)
        _need(
            t is None or t.shape == shape,
            f"batch.{name} must be {tuple(shape)}, got {None if t is None else tuple(t.shape)}",
        )
    for term, need in needs:
        if need.topk:
            k = batch.topk_logp
            _need(
                k is not None and batch.policy_topk_logp is not None and k.shape[:2] == shape
                and batch.policy_topk_logp.shape == k.shape,
                f"{term} needs batch.topk_logp and batch.policy_topk_logp of shape (B, T, K)",
            )  # fmt: skip
        _need(
            not need.reference or batch.ref_logp is not None,
            f"term {term!r} needs batch.ref_logp: pass reference log-probs or turn {term!r} off",
        )
    _need(batch.dp_world_size >= 1, "batch.dp_world_size must be >= 1")


def _section(entry: Term) -> str:
    assert entry.section is not None  # register_term requires it for additive terms
    return entry.section
