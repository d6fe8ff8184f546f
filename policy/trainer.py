"""The training step: rollout → credit → advantages → loss stack → one optimizer step.

Read first: :func:`train_step` (the whole flow, top to bottom), then :func:`policy_update`.
The credit comes from the ONE credit path (`evaluator.credit.compute_credits`); the loss from
the ONE stack built from a preset (`policy.losses`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from evaluator.actions import ActionExecutor
from evaluator.credit import CreditResult, RolloutActions, compute_credits
from evaluator.scorers import SetScorer
from policy.advantages import (
    CreditTable,
    GroupAdvantages,
    ShapingConfig,
    group_advantages,
    token_advantages,
)
from policy.forward import ValueHead, policy_forward
from policy.losses.batch import LossBatch
from policy.losses.stack import LossStack
from policy.rollout import Rollout, RolloutBatch, collate, sample_rollouts
from policy.sampler import SamplerConfig


@dataclass(frozen=True)
class StepConfig:
    """One training step's shape and optimizer knobs."""

    n_samples: int = 4
    """G: samples per query (the advantage group)."""
    n_actions: int = 4
    """m: rewrites asked for in one generation (players of the credit game, ≤ 12)."""
    list_k: int = 10
    """K of coalition lists and of the evaluator's nDCG@K."""
    micro_batch_size: int = 4
    """Sequences per forward/backward (the gradient is independent of it)."""
    max_grad_norm: float = 1.0
    anchor_query: bool = True
    """The user's query is an anchor in every coalition (METHODS §1); False = the plain game."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)

    def __post_init__(self) -> None:
        if self.n_samples < 2:
            raise ValueError(
                f"n_samples must be >= 2 (group advantages need a group), got {self.n_samples}"
            )
        if not 1 <= self.n_actions <= 12:
            raise ValueError(
                f"n_actions must be in 1..12 (exact Shapley is 2^m), got {self.n_actions}"
            )
        if self.micro_batch_size < 1 or self.list_k < 1 or not self.max_grad_norm > 0:
            raise ValueError("micro_batch_size and list_k must be >= 1 and max_grad_norm > 0")


@dataclass
class StepResult:
    rollouts: list[Rollout]
    credit: CreditResult
    base: Tensor  # (B, G) base advantages over each query's group
    shaped: Tensor  # (B, G, m) bounded zero-sum shaped credits x
    token_adv: Tensor  # (B·G, T)
    batch: RolloutBatch
    metrics: dict[str, float]


def train_step(
    model: nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    stack: LossStack,
    queries: Sequence[tuple[str, str]],
    executor: ActionExecutor,
    scorer: SetScorer,
    cfg: StepConfig,
    *,
    policy_version: str,
    value_head: ValueHead | None = None,
) -> StepResult:
    """One step on ``queries`` = [(query_id, text)]: sample, credit, shape, update."""
    b, g, m = len(queries), cfg.n_samples, cfg.n_actions
    model.eval()  # no dropout: sampling and recompute see the same function
    rollouts = sample_rollouts(
        model, tokenizer, [t for _, t in queries], g, m, cfg.sampler, policy_version
    )
    players = [
        RolloutActions(queries[r.query_index][0], r.query, [a.text for a in r.parsed.actions])
        for r in rollouts
    ]
    credit = compute_credits(
        players, executor, scorer, cfg.list_k, anchor_query=cfg.anchor_query
    )  # ONE call, every coalition
    adv = _group_advantages(credit, b, g, m, cfg.shaping)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = collate(rollouts, pad_token_id=pad, max_actions=m)
    token_adv = token_advantages(
        adv.base.reshape(-1),
        adv.x.reshape(b * g, m),
        batch.action_token_mask,
        batch.response_mask,
        cfg.shaping.lam,
    ).float()  # (B·G, T)
    rewards = credit.value_full.float()  # (B·G,) v(N), the critic's Monte-Carlo target
    metrics = policy_update(model, optimizer, stack, batch, token_adv, rewards, cfg, value_head)
    metrics.update(_step_metrics(credit, rollouts, adv.metrics, executor))
    return StepResult(rollouts, credit, adv.base, adv.x, token_adv, batch, metrics)


def _group_advantages(
    credit: CreditResult, b: int, g: int, m: int, cfg: ShapingConfig
) -> GroupAdvantages:
    """Credits (B·G, M') padded to m, grouped (B, G, m), then base + bounded zero-sum shaping."""

    def grouped(t: Tensor) -> Tensor:
        out = torch.zeros(b * g, m, dtype=torch.float64)
        out[:, : t.shape[1]] = t[:, :m]
        return out.reshape(b, g, m)

    table = CreditTable(
        shapley=grouped(credit.phi),
        singleton=grouped(credit.singleton),
        leave_one_out=grouped(credit.leave_one_out),
        broadcast=grouped(credit.broadcast),
    )
    mask = (torch.arange(m)[None, :] < credit.n_actions[:, None]).reshape(b, g, m)
    return group_advantages(credit.value_full.reshape(b, g), table, mask, cfg)


def policy_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stack: LossStack,
    batch: RolloutBatch,
    token_adv: Tensor,
    rewards: Tensor,
    cfg: StepConfig,
    value_head: ValueHead | None = None,
) -> dict[str, float]:
    """π_old recompute, then micro-batched loss with GLOBAL counts, clip, step (skipped if the
    gradient is not finite — the step never writes NaN into the weights).

    One step is on-policy, so the KL reference is π_old (the weights that sampled) and the
    critic's target at every response token is the rollout's Monte-Carlo return v(N) (reward at
    the end, γ = 1); a multi-step trainer passes a frozen reference and GAE returns instead.
    """
    temp = cfg.sampler.temperature
    needs = stack.cfg
    with_topk = "predictive_mask" in needs.terms
    chunks = [
        slice(i, i + cfg.micro_batch_size) for i in range(0, len(batch), cfg.micro_batch_size)
    ]
    with torch.no_grad():
        old = [policy_forward(model, batch.select(c), temp) for c in chunks]
    mask = batch.response_mask
    global_tokens = int(mask.sum())
    global_seqs = int(mask.any(-1).sum())
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {"loss": 0.0}
    for c, o in zip(chunks, old, strict=True):
        mb = batch.select(c)
        f = policy_forward(
            model,
            mb,
            temp,
            with_topk=with_topk,
            with_entropy=needs.entropy_coef > 0,
            value_head=value_head if needs.critic.kind != "none" else None,
        )
        returns = rewards[c, None].expand_as(f.logp) if f.values is not None else None
        lb = LossBatch(
            logp=f.logp,
            old_logp=o.logp,
            sampler_logp=mb.sampler_logp,
            advantages=token_adv[c],
            response_mask=mb.response_mask,
            ref_logp=o.logp if needs.kl is not None else None,
            topk_logp=mb.topk_logp if with_topk else None,
            topk_ids=mb.topk_ids if with_topk else None,
            policy_topk_logp=f.topk_logp,
            values=f.values,
            old_values=f.values.detach() if f.values is not None else None,
            returns=returns,
            entropy=f.entropy,
            versions=torch.zeros(len(mb), dtype=torch.long),
            global_tokens=global_tokens,
            global_seqs=global_seqs,
        )
        loss, m = stack(lb)
        loss.backward()  # type: ignore[no-untyped-call]
        sums["loss"] += float(
            loss.detach()
        )  # global counts: micro-batch losses add up to the step's loss
        share = float(mb.response_mask.sum()) / max(global_tokens, 1)  # token-weighted metric mean
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v) * share
    params = [p for grp in optimizer.param_groups for p in grp["params"]]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if stack.kl_controller is not None and "kl/value" in sums:
        stack.kl_controller.update(torch.tensor(sums["kl/value"]))
    return {
        **sums,
        "grad_norm": grad_norm,
        "step_applied": float(finite),
        "tokens": float(global_tokens),
    }


def _step_metrics(
    credit: CreditResult, rollouts: list[Rollout], adv: dict[str, Tensor], executor: ActionExecutor
) -> dict[str, float]:
    totals = executor.cache.stats.as_dict()
    statuses = [r.parsed.status for r in rollouts]
    return {
        "reward_mean": float(credit.value_full.mean()),
        "efficiency_residual_max": float(credit.residual.abs().max()),
        "cache_hits": float(credit.cache["hits"]),
        "cache_misses": float(credit.cache["misses"]),
        "cache_hit_rate_total": float(totals["hit_rate"]),
        "format_ok_fraction": statuses.count("ok") / len(statuses),
        **{f"shaping/{k}": float(v) for k, v in adv.items()},
    }
