"""Teacher-forced forward of the training model over a rollout batch.

Read first: :func:`policy_forward`. One forward gives, for the response tokens, log π (with or
without gradient), and on request log π at the sampler's top-K ids, the per-token entropy and
value-head predictions — everything the loss stack's terms can ask for.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from policy.rollout import RolloutBatch
from policy.sampler import response_log_softmax


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
    log-softmax of logits / temperature). Gradients flow unless called under no_grad."""
    logp_all, hidden = response_log_softmax(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        batch.response_ids.shape[1],
        temperature,
        output_hidden_states=value_head is not None,
    )  # (B, T, V), (B, T, H): the state before emitting token t
    logp = logp_all.gather(-1, batch.response_ids[..., None]).squeeze(-1)  # (B, T)
    topk = logp_all.gather(-1, batch.topk_ids) if with_topk else None
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    values = value_head(hidden) if value_head is not None and hidden is not None else None
    return ForwardOut(logp, topk, entropy, values)
