"""The loss stack: one pg term × weights × masks, plus additive terms, aggregated ONCE.

    loss_tok = pg_loss_t · Π_k w_k,t · 1[all token/sequence masks keep t]
               + λ_KL · kl_t − β · H_t + c_V · critic_t
    loss     = aggregate(loss_tok, response_mask, mode, global_tokens, global_seqs, horizon)

Read `LossStack.__call__` first. Terms come from the registry by name; the stack never
branches on a term's identity. Shared quantities are computed once per call in `LossContext`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from policy.losses.aggregate import aggregate
from policy.losses.batch import LossBatch, LossContext
from policy.losses.config import StackConfig
from policy.losses.kl import DualKLController
from policy.losses.ops import fraction, masked_mean
from policy.losses.registry import TermFn, TermOutput, get_term

Metrics = dict[str, Tensor]


class LossStack:
    """Build once from a `StackConfig`; call on each micro-batch: `loss, metrics = stack(b)`.

    `kl_controller` (when cfg.kl.dual is set) holds λ; the trainer calls
    `stack.kl_controller.update(metrics["kl/value"])` once per optimizer step.
    """

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self._pg = get_term(cfg.pg, "pg")
        self._modifiers = [(name, get_term(name, "modifier")) for name in cfg.terms]
        additive = [
            ("kl", cfg.kl is not None),
            ("entropy", cfg.entropy_coef > 0),
            ("critic", cfg.critic.kind != "none"),
        ]
        self._additive = [(name, get_term(name, "additive")) for name, on in additive if on]
        dual = cfg.kl.dual if cfg.kl is not None else None
        self.kl_controller = DualKLController(dual) if dual is not None else None

    def coefficient(self, name: str) -> float:
        """Current weight of an additive term (λ_KL may move under the dual controller)."""
        if name == "kl":
            if self.kl_controller is not None:
                return self.kl_controller.coef
            return self.cfg.kl.coef if self.cfg.kl is not None else 0.0
        return self.cfg.entropy_coef if name == "entropy" else self.cfg.critic.coef

    def __call__(self, batch: LossBatch) -> tuple[Tensor, Metrics]:
        """Total loss (0-d, differentiable) and detached 0-d metrics keyed 'term/metric'."""
        check_batch(batch, self.cfg)
        ctx = LossContext(batch)
        metrics: Metrics = {}
        pg_out = _run(self.cfg.pg, self._pg, ctx, self.cfg, metrics)
        assert pg_out.loss is not None, f"pg term {self.cfg.pg!r} returned no loss"
        keep, weight = self._modifier_outputs(pg_out, ctx, metrics)
        pg_tok = pg_out.loss if weight is None else pg_out.loss * weight
        total = pg_tok if keep is None else torch.where(keep, pg_tok, torch.zeros_like(pg_tok))
        for name, fn in self._additive:
            out = _run(name, fn, ctx, self.cfg, metrics)
            assert out.loss is not None, f"additive term {name!r} returned no loss"
            total = total + self.coefficient(name) * out.loss
        loss = aggregate(
            total,
            ctx.valid,
            self.cfg.aggregation,
            ctx.n_tokens if batch.global_tokens is None else batch.global_tokens,
            ctx.seq_valid.sum() if batch.global_seqs is None else batch.global_seqs,
            self.cfg.horizon,
            batch.dp_world_size,
        )
        metrics.update(_shared_metrics(ctx, keep))
        return loss, metrics

    def _modifier_outputs(
        self, pg_out: TermOutput, ctx: LossContext, metrics: Metrics
    ) -> tuple[Tensor | None, Tensor | None]:
        """Product of token weights and AND of token/sequence masks over pg + modifiers."""
        keep, weight = _merge(None, None, pg_out)
        for name, fn in self._modifiers:
            keep, weight = _merge(keep, weight, _run(name, fn, ctx, self.cfg, metrics))
        return keep, weight


def _run(name: str, fn: TermFn, ctx: LossContext, cfg: StackConfig, metrics: Metrics) -> TermOutput:
    out = fn(ctx, cfg)
    metrics.update({f"{name}/{k}": v.detach() for k, v in out.metrics.items()})
    return out


def _merge(
    keep: Tensor | None, weight: Tensor | None, out: TermOutput
) -> tuple[Tensor | None, Tensor | None]:
    if out.token_weight is not None:
        w = out.token_weight.detach()
        weight = w if weight is None else weight * w
    masks = [out.token_mask]
    if out.seq_mask is not None:
        masks.append(out.seq_mask[:, None])
    for m in masks:
        if m is not None:
            keep = m if keep is None else keep & m
    return keep, weight


def _shared_metrics(ctx: LossContext, keep: Tensor | None) -> Metrics:
    """Mismatch KL between π_old and μ, and how many tokens survived all masks."""
    with torch.no_grad():
        ell, n = ctx.mismatch_sg, ctx.n_tokens
        kept = ctx.valid if keep is None else (keep & ctx.valid)
        n_kept = kept.sum()
        return {
            "mismatch/log_ratio_mean": masked_mean(ell, ctx.mask, n),
            "mismatch/kl_k1": -masked_mean(ell, ctx.mask, n),
            "mismatch/kl_k3": masked_mean(ctx.is_ratio_sg - 1 - ell, ctx.mask, n),
            "stack/kept_frac": fraction(kept, ctx.mask, n),
            "stack/n_tokens": n.detach(),
            "stack/fully_masked": (n_kept == 0).to(ctx.mask.dtype),
        }


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def check_batch(batch: LossBatch, cfg: StackConfig) -> None:
    """Shapes agree and every tensor the configured terms read is present (says how to fix)."""
    shape = batch.logp.shape
    _need(len(shape) == 2, f"batch.logp must be (B, T), got {tuple(shape)}")
    for name in ("old_logp", "sampler_logp", "advantages", "response_mask", "ref_logp",
                 "values", "old_values", "returns", "entropy"):  # fmt: skip
        t = getattr(batch, name)
        _need(
            t is None or t.shape == shape,
            f"batch.{name} must be {tuple(shape)}, got {None if t is None else tuple(t.shape)}",
        )
    if "predictive_mask" in cfg.terms:
        k = batch.topk_logp
        _need(
            k is not None and batch.policy_topk_logp is not None and k.shape[:2] == shape
            and batch.policy_topk_logp.shape == k.shape,
            "predictive_mask needs batch.topk_logp and batch.policy_topk_logp of shape (B, T, K)",
        )  # fmt: skip
    _need(cfg.kl is None or batch.ref_logp is not None,
          "cfg.kl is set but batch.ref_logp is None: pass reference log-probs or set kl = None")  # fmt: skip
    _need(batch.dp_world_size >= 1, "batch.dp_world_size must be >= 1")
