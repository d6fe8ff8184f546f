"""THE teacher-forced forward of the training model over a rollout batch, and the loss batch.

Read first: :func:`policy_forward`. One forward gives, for the response tokens, log π (with or
without gradient), and on request log π at the sampler's top-K ids, the per-token entropy and
value-head predictions — everything the loss stack's terms can ask for. It is the only place a
model is run teacher-forced (through `policy.sampler.response_log_softmax`); `logprobs` is its
no-grad, micro-batched form, `build_loss_batch` turns one micro-batch's forward into the typed
`LossBatch` the stack consumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from policy.losses.batch import LossBatch
from policy.losses.stack import StackNeeds
from policy.rollout import RolloutBatch
from policy.sampler import model_device, response_log_softmax


class ValueHead(nn.Module):
    """Scalar value per position from the last hidden state (zero-initialised: V ≡ 0 at start)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:  # (B, T, H) → (B, T)
        out: Tensor = self.proj(hidden.float()).squeeze(-1)
        return out


@dataclass
class ForwardOut:
    logp: Tensor  # (B, T) log π(y_t)
    topk_logp: Tensor | None  # (B, T, K) log π at the sampler's top-K ids
    entropy: Tensor | None  # (B, T) H(π(·|s_t))
    values: Tensor | None  # (B, T) V(s_t)


def policy_forward(
    model: nn.Module,
    batch: RolloutBatch,
    temperature: float,
    *,
    with_topk: bool = False,
    with_entropy: bool = False,
    value_head: ValueHead | None = None,
) -> ForwardOut:
    """Log-probs of the batch's response tokens under ``model`` (same convention as μ:
    log-softmax of logits / temperature). Gradients flow unless called under no_grad.
    Values at pads are garbage: always mask with ``batch.response_mask``."""
    batch = batch.to(model_device(model))
    logp_all, hidden = response_log_softmax(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        batch.response_ids.shape[1],
        temperature,
        output_hidden_states=value_head is not None,
        constraint=batch.format_constraint,  # constrained rollouts: the same renormalization as μ
    )  # (B, T, V), (B, T, H): the state before emitting token t
    logp = logp_all.gather(-1, batch.response_ids[..., None]).squeeze(-1)  # (B, T)
    topk = logp_all.gather(-1, batch.topk_ids) if with_topk else None
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    values = value_head(hidden) if value_head is not None and hidden is not None else None
    return ForwardOut(logp, topk, entropy, values)


@torch.no_grad()
def logprobs(
    model: nn.Module, batch: RolloutBatch, temperature: float = 1.0, micro_batch_size: int = 8
) -> Tensor:
    """(B, T) log π of the response tokens, no gradient, micro-batched; 0 at pads and at
    forced tokens (CPU)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 (got {micro_batch_size}).")
    parts = []
    for start in range(0, len(batch), micro_batch_size):
        mb = batch.select(slice(start, start + micro_batch_size))
        logp = policy_forward(model, mb, temperature).logp.float().cpu()
        parts.append(logp.masked_fill(~mb.loss_mask, 0.0))
    return torch.cat(parts)


def build_loss_batch(
    out: ForwardOut,
    mb: RolloutBatch,
    advantages: Tensor,
    needs: StackNeeds,
    *,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    old_values: Tensor | None,
    returns: Tensor | None,
    global_tokens: int,
    global_seqs: int,
    dp_world_size: int = 1,
) -> LossBatch:
    """The stack's typed batch for one micro-batch: what the stack needs, nothing more.

    ``old_logp`` is log π_old (detached); ``ref_logp`` the frozen reference's log-probs (KL);
    ``old_values``/``returns`` the critic's clip anchor and target; counts are GLOBAL (all
    micro-batches and ranks of the optimizer step) so the gradient does not depend on the split.
    """
    device = out.logp.device
    return LossBatch(
        logp=out.logp,
        old_logp=old_logp.to(device),
        sampler_logp=mb.sampler_logp.to(device),
        advantages=advantages.to(device),
        response_mask=mb.loss_mask.to(device),  # forced format tokens are outside every term
        ref_logp=ref_logp.to(device) if needs.reference and ref_logp is not None else None,
        topk_logp=mb.topk_logp.to(device) if needs.topk else None,
        topk_ids=mb.topk_ids.to(device) if needs.topk else None,
        policy_topk_logp=out.topk_logp,
        values=out.values,
        old_values=old_values.to(device) if old_values is not None else None,
        returns=returns.to(device) if returns is not None else None,
        entropy=out.entropy,
        versions=torch.zeros(len(mb), dtype=torch.long, device=device),
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        dp_world_size=dp_world_size,
    )
