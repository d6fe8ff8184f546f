"""The one aggregation helper: per-token losses (B, T) → the scalar that is differentiated.

Each mode is named after its denominator and takes GLOBAL counts (all micro-batches of the
optimizer step, all data-parallel ranks), so that Σ_micro loss_micro equals the full-batch
loss and DDP's gradient average equals the full-batch gradient. The bug this prevents:
x1/n1 + x2/n2 ≠ (x1 + x2)/(n1 + n2) (TRL #3231, torchtune #1875).
"""

from __future__ import annotations

from typing import Final

import torch
from torch import Tensor

AGGREGATION_MODES: Final = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
"""token-mean: Σ_{i,t} ℓ / N_tokens.  seq-mean-token-mean: Σ_i (Σ_t ℓ / n_i) / N_seqs.
seq-mean-token-sum: Σ_{i,t} ℓ / N_seqs.  seq-mean-token-sum-norm: Σ_{i,t} ℓ / (N_seqs · H)
(Dr.GRPO: a fixed horizon H instead of the sequence's own length)."""


def _as_count(x: int | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(x, dtype=like.dtype, device=like.device).clamp_min(1)


def aggregate(
    loss_tok: Tensor,
    mask: Tensor,
    mode: str,
    global_tokens: int | Tensor,
    global_seqs: int | Tensor,
    horizon: int | None = None,
    dp_world_size: int = 1,
) -> Tensor:
    """Reduce per-token losses to one 0-d loss.

    loss_tok: (B, T); mask: (B, T) bool response mask. Positions outside the mask are
    replaced by 0 (not multiplied, so a NaN/inf there cannot leak). Empty counts are clamped
    to 1, so a batch with no valid token gives exactly 0. The result is multiplied by
    `dp_world_size` so that DDP's gradient mean equals the full-batch gradient.
    """
    valid = mask if mask.dtype == torch.bool else mask > 0
    masked = torch.where(valid, loss_tok, torch.zeros((), dtype=loss_tok.dtype))
    if mode == "token-mean":
        total = masked.sum() / _as_count(global_tokens, loss_tok)
    elif mode == "seq-mean-token-mean":
        n_i = valid.sum(-1).to(loss_tok.dtype).clamp_min(1)  # local to each sequence
        total = (masked.sum(-1) / n_i).sum() / _as_count(global_seqs, loss_tok)
    elif mode == "seq-mean-token-sum":
        total = masked.sum() / _as_count(global_seqs, loss_tok)
    elif mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon <= 0:
            raise ValueError("seq-mean-token-sum-norm needs horizon > 0 (max response length)")
        total = masked.sum() / (_as_count(global_seqs, loss_tok) * horizon)
    else:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {list(AGGREGATION_MODES)}")
    return total * dp_world_size
