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
from policy.losses.registry import Needs, TermOutput, register_term


def anchor_columns(valid: Tensor, fractions: tuple[float, ...]) -> tuple[Tensor, Tensor]:
    """Columns of the SP3O anchors and which of them count. valid: (B, T) bool.

    Anchor k-th valid tokens: ⌊f·L⌋ for each f (sorted) and L − 1, L = valid tokens of the row
    (counted by cumsum, so left padding is fine). Returns (cols (B, F+1) int64, ok (B, F+1)
    bool): ok is False for repeated anchors of short responses and for empty responses.
    """
    csum = valid.long().cumsum(-1)  # (B, T) nondecreasing
    length = csum[:, -1:]  # (B, 1)
    f = torch.tensor(sorted(fractions), dtype=torch.float64, device=valid.device)
    k = torch.cat([(f * length).floor().long(), length - 1], -1)  # (B, F+1) nondecreasing
    cols = torch.searchsorted(csum, k + 1).clamp(max=valid.shape[-1] - 1)  # column of k-th token
    ok = torch.ones_like(k, dtype=torch.bool)
    ok[:, 1:] = k[:, 1:] != k[:, :-1]
    return cols, ok & (length > 0)


def anchor_mask(mask: Tensor, fractions: tuple[float, ...]) -> Tensor:
    """(B, T) bool: True exactly at the SP3O anchor positions of each response."""
    valid = mask if mask.dtype == torch.bool else mask > 0
    cols, ok = anchor_columns(valid, fractions)
    hits = torch.zeros(valid.shape, dtype=torch.long, device=valid.device)
    return hits.scatter_add_(1, cols, ok.long()) > 0


def value_loss(
    values: Tensor, returns: Tensor, old_values: Tensor | None, clip: float | None
) -> tuple[Tensor, Tensor]:
    """Clipped value loss per entry (any shape) and the bool map where the clipped branch wins."""
    returns = returns.detach()
    err = (values - returns) ** 2
    if clip is None or old_values is None:
        return 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    old = old_values.detach()
    v_clip = old + (values - old).clamp(-clip, clip)
    err_clip = (v_clip - returns) ** 2
    clipped = err_clip > err
    return 0.5 * torch.where(clipped, err_clip, err), clipped


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


def _sparse_critic(
    ctx: LossContext, c: CriticConfig, values: Tensor, returns: Tensor
) -> TermOutput:
    """SP3O: the value loss is computed on the (B, F+1) anchors only, then scattered to (B, T)."""
    cols, ok = anchor_columns(ctx.valid, c.anchors)
    old = ctx.batch.old_values
    old_a = None if old is None else old.gather(1, cols)
    loss_a, clipped = value_loss(
        values.gather(1, cols), returns.gather(1, cols), old_a, c.value_clip
    )
    okf = ok.to(loss_a.dtype)
    n_anchor = okf.sum(-1, keepdim=True)  # (B, 1)
    weight = okf * (ctx.seq_len[:, None] / n_anchor.clamp_min(1)) if c.rescale_sparse else okf
    loss = torch.zeros_like(values).scatter_add(1, cols, loss_a * weight)  # (B, T)
    n_ok = n_anchor.sum()
    metrics = {
        "loss_mean": (loss_a.detach() * okf).sum() / n_ok.clamp_min(1),
        "clip_frac": (clipped & ok).sum() / n_ok.clamp_min(1),
        "anchor_frac": n_ok / ctx.n_tokens.clamp_min(1),
    }
    return TermOutput(loss=loss, metrics=metrics)


def _on(c: CriticConfig) -> bool:
    return c.kind != "none"


def _coef(c: CriticConfig) -> float:
    return c.coef


@register_term(
    "critic", kind="additive", section="critic", enabled=_on, coefficient=_coef,
    needs=Needs(values=True), order=30,
)  # fmt: skip
def critic(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Dense or SP3O value loss per token (the stack multiplies it by critic.coef)."""
    c = cfg.critic
    values, returns = _check_inputs(ctx, c)
    if c.kind == "sp3o":
        return _sparse_critic(ctx, c, values, returns)
    loss, clipped = value_loss(values, returns, ctx.batch.old_values, c.value_clip)
    return TermOutput(loss=loss, token_metrics={"loss_mean": loss, "clip_frac": clipped})


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
