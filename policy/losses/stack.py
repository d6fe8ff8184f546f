"""The loss stack: one pg term × weights × masks, plus additive terms, aggregated ONCE.

    loss_tok = pg_loss_t · Π_k w_k,t · Π_k keep_k,t      (one detached factor)
               + λ_KL · kl_t − β · H_t + c_V · critic_t
    loss     = aggregate(loss_tok, response_mask, mode, global_tokens, global_seqs, horizon)

Read `LossStack.__call__` first. Terms come from the registry by name: pg and modifier terms
compose generically (a new mask or weight needs no edit here); the additive terms are the
configured KL, entropy and critic. Shared quantities are computed once in `LossContext`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from policy.losses.aggregate import aggregate
from policy.losses.batch import LossBatch, LossContext
from policy.losses.config import StackConfig
from policy.losses.kl import DualKLController
from policy.losses.masks import mismatch_out_of_band
from policy.losses.ops import mean_over_tokens
from policy.losses.registry import TermFn, TermOutput, get_term

Metrics = dict[str, Tensor]


@dataclass(frozen=True)
class StackNeeds:
    """Which optional inputs the configured terms read (the trainer computes only these)."""

    topk: bool
    """Sampler top-K log-probs and π at those ids (predictive divergence mask)."""
    entropy: bool
    """Per-token entropy of π (entropy bonus)."""
    values: bool
    """Value-head predictions, old values and returns (critic)."""
    reference: bool
    """Log-probs of the frozen reference policy (KL)."""


class LossStack:
    """Build once from a `StackConfig`; call on each micro-batch: `loss, metrics = stack(b)`.

    `kl_controller` (when cfg.kl.dual is set) holds λ; the trainer calls
    `stack.kl_controller.update(kl)` once per optimizer step with the step's mean KL (e.g. the
    token-weighted mean of the micro-batches' `metrics["kl/value"]`).
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

    @property
    def needs(self) -> StackNeeds:
        """What a `LossBatch` must carry for this configuration."""
        cfg = self.cfg
        return StackNeeds(
            topk="predictive_mask" in cfg.terms,
            entropy=cfg.entropy_coef > 0,
            values=cfg.critic.kind != "none",
            reference=cfg.kl is not None,
        )

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
