"""Critic loss, dense or SP3O sparse, with value clipping; and the GAE helper.

    value loss (per token): ½ max((V − R)², (V_old + clip(V − V_old, ±c) − R)²)
    dense:  every valid response token.
    SP3O:   only anchor positions ⌊f·L⌋ (f ∈ anchors, default 0.3, 0.6, 0.9) and L − 1 of each
            response, L its own number of valid tokens; anchors weighted by L / n_anchors
            (ours, `rescale_sparse`) so the loss scale matches the dense loss.

Read `critic` first; `gae` computes advantages and returns for the trainer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from policy.losses.batch import LossContext
from policy.losses.config import CriticConfig, StackConfig
from policy.losses.ops import fraction, masked_mean
from policy.losses.registry import TermOutput, register_term


def anchor_mask(mask: Tensor, fractions: tuple[float, ...]) -> Tensor:
    """(B, T) bool: anchor positions ⌊f·L⌋ and L − 1 within each response's valid tokens.

    Positions count valid tokens only (cumsum of the mask), so left padding is fine.
    """
    valid = mask if mask.dtype == torch.bool else mask > 0
    pos = valid.long().cumsum(-1) - 1  # (B, T) index among valid tokens
    length = valid.sum(-1, keepdim=True)  # (B, 1)
    f = torch.tensor(fractions, dtype=torch.float64, device=mask.device)
    targets = torch.cat([(f * length).floor().long(), length - 1], -1)  # (B, F+1)
    return (pos[..., None] == targets[:, None, :]).any(-1) & valid


def value_loss(
    values: Tensor, returns: Tensor, old_values: Tensor | None, clip: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss (B, T) and the bool map where the clipped branch wins."""
    returns = returns.detach()
    err = (values - returns) ** 2
    if clip is None or old_values is None:
        return 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    old = old_values.detach()
    v_clip = old + (values - old).clamp(-clip, clip)
    err_clip = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(err, err_clip), err_clip > err


def _check_inputs(ctx: LossContext, cfg: CriticConfig) -> tuple[Tensor, Tensor]:
    b = ctx.batch
    if b.values is None or b.returns is None:
        raise ValueError(
            f"critic {cfg.kind!r} needs batch.values and batch.returns (value head outputs and "
            "GAE returns); provide them or set critic.kind = 'none'"
        )
    if cfg.value_clip is not None and b.old_values is None:
        raise ValueError(
            "critic.value_clip needs batch.old_values; provide them or set value_clip = None"
        )
    return b.values, b.returns


@register_term("critic", kind="additive")
def critic(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Dense or SP3O value loss per token (the stack multiplies it by critic.coef)."""
    c = cfg.critic
    values, returns = _check_inputs(ctx, c)
    loss, clipped = value_loss(values, returns, ctx.batch.old_values, c.value_clip)
    where = ctx.mask
    if c.kind == "sp3o":
        anchors = anchor_mask(ctx.valid, c.anchors).to(loss.dtype)
        if c.rescale_sparse:
            anchors = anchors * (ctx.seq_len / anchors.sum(-1).clamp_min(1))[:, None]
        loss = loss * anchors
        where = (anchors > 0).to(ctx.mask.dtype)
    metrics = {
        "loss_mean": masked_mean(loss, where),
        "clip_frac": fraction(clipped, where),
        "anchor_frac": masked_mean(where, ctx.mask, ctx.n_tokens),
    }
    return TermOutput(loss=loss, metrics=metrics)


@torch.no_grad()
def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over valid tokens. All inputs (B, T).

    δ_t = r_t + γ V_{t+1} − V_t, A_t = δ_t + γλ A_{t+1}, where "t + 1" is the next VALID token
    (padding is skipped) and V after the last valid token is 0. Returns (advantages, returns
    = A + V), both detached, zero outside the mask.
    """
    m = (mask if mask.dtype != torch.bool else mask.to(values.dtype)).to(values.dtype)
    batch, horizon = values.shape
    next_v = torch.zeros(batch, dtype=values.dtype, device=values.device)
    last = torch.zeros_like(next_v)
    adv = torch.zeros_like(values)
    for t in reversed(range(horizon)):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        cur = delta + gamma * lam * last
        mt = m[:, t]
        last = mt * cur + (1 - mt) * last
        next_v = mt * values[:, t] + (1 - mt) * next_v
        adv[:, t] = mt * cur
    return adv, (adv + values) * m
