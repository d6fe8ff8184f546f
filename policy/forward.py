"""THE teacher-forced forward of the training model over a rollout batch, and the loss batch.

Read first: :func:`policy_forward`. One forward gives, for the response tokens, log π (with or
without gradient), and on request log π at the sampler's top-K ids, the per-token entropy and
value-head predictions — everything the loss stack's terms can ask for. It is the only place a
model is run teacher-forced (through :func:`response_log_softmax`, below); `logprobs` is its
no-grad, micro-batched form, `build_loss_batch` turns one micro-batch's forward and its
`MiniBatch` inputs into the typed `LossBatch` the stack consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from transformers.masking_utils import create_causal_mask

from policy.constrain import constrained_log_softmax, format_bias
from policy.kvcache import new_cache
from policy.losses.batch import LossBatch
from policy.losses.registry import Needs
from policy.rollout import RolloutBatch
from policy.sampler import forward_kwargs, model_device

SHARE_PROMPT = True
"""Rows with the same prompt (the G samples of a query) run it once: the prompt's states with
its KV cache, copied to the rows, then the responses on that cache (`_last_hidden`). False is
the previous path, every row its own prompt (kept for ``benchmarks/bench_train.py``)."""
TRIM_PADS = True
"""Drop the columns no row uses (left prompt pads, response columns past every row's end)
before the forward (`policy_forward`). False is the previous path (kept for benchmarks)."""


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


def response_log_softmax(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    steps: int,
    temperature: float,
    output_hidden_states: bool = False,
    constraint: tuple[Tensor, Tensor, Tensor] | None = None,
    trunk: tuple[Tensor, int] | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """THE teacher-forced forward: log_softmax(logits / T) at the positions that predict the
    last ``steps`` tokens, (B, T, V), and optionally the last hidden state there (B, T, H).

    input_ids (B, P+T): left-padded prompt then right-padded response, so the response occupies
    the last T columns. Only the T+1 last logits are computed when the model supports it.
    ``constraint`` (class table (C, V), classes (B, T), forced tokens (B, T)): the
    format-constrained policy, renormalized over each position's allowed set exactly as the
    sampler drew (policy.constrain); None = the free policy.
    ``trunk`` (hidden (B, P+T, H), L): the hidden state entering decoder layer L at every
    position, recorded by the sampler; only layers L.. run (the frozen ones below are not
    recomputed: `params = top`). The last hidden state is then after the final norm, as HF's.
    ``keep`` (B, T) bool: score only these positions (the loss tokens: no pads, no forced
    format tokens); the outputs are then (N, V) and (N, H) over ``keep``'s True entries in
    row-major order, and the output head runs on those N rows only (a Hugging Face model with
    ``model`` + ``lm_head``; any other module is run whole and the rows picked after).
    """
    split = hasattr(model, "model") and hasattr(model, "lm_head")
    if trunk is not None or (keep is not None and split):
        last = (
            _upper_hidden(model, trunk, attention_mask, position_ids, steps)
            if trunk is not None
            else _last_hidden(model, input_ids, attention_mask, position_ids, steps)
        )  # (B, T, H) after the final norm
        if keep is not None:
            last = last[keep]
        logits: Tensor = getattr(model, "lm_head")(last)  # noqa: B009
        hidden = last if output_hidden_states else None
    else:
        kwargs: dict[str, Any] = {}
        if "logits_to_keep" in forward_kwargs(model):
            kwargs["logits_to_keep"] = steps + 1  # only the positions that predict response tokens
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            output_hidden_states=output_hidden_states,
            **kwargs,
        )
        logits = out.logits[:, -(steps + 1) : -1]  # (B, T, V): position P-1+t predicts token t
        hidden = out.hidden_states[-1][:, -(steps + 1) : -1] if output_hidden_states else None
        if keep is not None:
            logits, hidden = logits[keep], (hidden[keep] if hidden is not None else None)
    if constraint is not None and keep is not None:
        table, cls, forced = constraint
        constraint = (table, cls[keep], forced[keep])
    allowed = None if constraint is None else format_bias(*constraint, vocab=logits.shape[-1])
    return constrained_log_softmax(logits.float() / temperature, allowed), hidden


def _last_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, steps: int
) -> Tensor:
    """(B, T, H): the base model's last hidden state (after the final norm) at the positions
    that predict the last ``steps`` tokens.

    Rows whose prompts are equal (consecutive runs: the G samples of a query) share one prompt
    forward (`SHARE_PROMPT`): the distinct prompts run once with a KV cache, the cache is
    copied to their rows (gradients of the copies add up in the prompt's states, as the G
    separate prompt forwards' did), and the responses run on it. Same values to float32
    rounding; the prompt costs 1/G of its compute, forward and backward."""
    inner = getattr(model, "model")  # noqa: B009  (the HF base model: no output head here)
    owner = _prompt_owner(input_ids, attention_mask, steps) if SHARE_PROMPT else None
    if owner is None or steps < 2:
        out = inner(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=False,
        )  # fmt: skip
        hidden: Tensor = out.last_hidden_state[:, -(steps + 1) : -1]
        return hidden
    p = input_ids.shape[1] - steps
    firsts = torch.cat([owner.new_zeros(1), (owner[1:] != owner[:-1]).nonzero().squeeze(-1) + 1])
    cache_kw = "cache" if "cache" in forward_kwargs(inner) else "past_key_values"
    cache = new_cache(model)
    prompt = inner(
        input_ids=input_ids[firsts, :p], attention_mask=attention_mask[firsts, :p],
        position_ids=position_ids[firsts, :p], use_cache=True, **{cache_kw: cache},
    )  # fmt: skip
    cache.batch_select_indices(owner)  # (U, …) → (B, …): each row reads its prompt's states
    rest = inner(
        input_ids=input_ids[:, p : p + steps - 1], attention_mask=attention_mask[:, : p + steps - 1],
        position_ids=position_ids[:, p : p + steps - 1], use_cache=True, **{cache_kw: cache},
    )  # fmt: skip
    # the last prompt position predicts response token 0; response position t, token t + 1
    first = prompt.last_hidden_state[:, -1:].index_select(0, owner)
    return torch.cat([first, rest.last_hidden_state], dim=1)


def _prompt_owner(input_ids: Tensor, attention_mask: Tensor, steps: int) -> Tensor | None:
    """(B,) index of each row's prompt among the distinct consecutive prompts, or None when
    no two neighbouring rows share one (nothing to save)."""
    p = input_ids.shape[1] - steps
    if input_ids.shape[0] < 2 or p < 1:
        return None
    ids, mask = input_ids[:, :p], attention_mask[:, :p]
    same = (ids[1:] == ids[:-1]).all(-1) & (mask[1:] == mask[:-1]).all(-1)
    if not bool(same.any()):
        return None
    return torch.cat([same.new_zeros(1, dtype=torch.long), (~same).long().cumsum(0)])


def _upper_hidden(
    model: nn.Module,
    trunk: tuple[Tensor, int],
    attention_mask: Tensor,
    position_ids: Tensor,
    steps: int,
) -> Tensor:
    """Decoder layers L.. of a Hugging Face causal LM (``model.model.layers``) on the recorded
    hidden state entering layer L, then the final norm, at the positions that predict the last
    ``steps`` tokens: (B, T, H). The same mask, rotary embeddings and layer calls as
    ``LlamaModel.forward``."""
    hidden, start = trunk
    inner = getattr(model, "model")  # noqa: B009  (the HF base model)
    param = next(model.parameters())
    hidden = hidden.to(device=param.device, dtype=param.dtype)  # the residual stream's dtype
    mask = create_causal_mask(
        config=inner.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
        position_ids=position_ids,
    )  # fmt: skip
    rotary = inner.rotary_emb(hidden, position_ids=position_ids)
    for layer in inner.layers[start:]:
        out = layer(
            hidden, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids
        )
        hidden = out[0] if isinstance(out, tuple) else out
    last: Tensor = inner.norm(hidden[:, -(steps + 1) : -1])  # RMSNorm is per position
    return last


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
    log-softmax of logits / temperature). Gradients flow unless called under no_grad. Only the
    loss tokens (``batch.loss_mask``) are scored: every output is 0 at pads and at forced format
    tokens (whose log-prob is exactly 0 under every policy)."""
    batch = batch.to(model_device(model))
    keep = batch.loss_mask  # only the tokens the loss reads: no pads, no forced format tokens
    run = trimmed(batch) if TRIM_PADS else batch
    logp_all, hidden = response_log_softmax(
        model,
        run.input_ids,
        run.attention_mask,
        run.position_ids,
        run.response_ids.shape[1],
        temperature,
        output_hidden_states=value_head is not None,
        constraint=run.format_constraint,  # constrained rollouts: the same renormalization as μ
        trunk=run.trunk_input,  # params = top: only the trained layers run, on the sampler's state
        keep=run.loss_mask,
    )  # (N, V), (N, H) over the kept positions: the state before emitting token t

    def spread(values: Tensor) -> Tensor:  # (N, ...) → (B, T, ...), 0 where nothing was scored
        out = values.new_zeros((*keep.shape, *values.shape[1:]))
        out[keep] = values  # trimmed columns hold no kept position: the same row-major order
        return out

    logp = spread(logp_all.gather(-1, batch.response_ids[keep][:, None]).squeeze(-1))  # (B, T)
    topk = spread(logp_all.gather(-1, batch.topk_ids[keep])) if with_topk else None
    entropy = spread(-(logp_all.exp() * logp_all).sum(-1)) if with_entropy else None
    values = spread(value_head(hidden)) if value_head is not None and hidden is not None else None
    return ForwardOut(logp, topk, entropy, values)


def trimmed(batch: RolloutBatch) -> RolloutBatch:
    """The batch without the columns no row uses: prompt columns that are padding in every row
    (prompts are left-padded) and response columns past every row's last token. A micro-batch
    keeps the width of the whole step's batch (`RolloutBatch.select`), so this is where its
    own, usually narrower, width is found. The forward's values at real positions are the same
    (a padded column is masked out of every attention row)."""
    p, t = batch.prompt_width, batch.response_ids.shape[1]
    used = batch.attention_mask[:, :p].bool().any(0)
    lo = int(used.nonzero()[0]) if bool(used.any()) else 0
    real = batch.response_mask.any(0) | batch.loss_mask.any(0)
    hi = int(real.nonzero()[-1]) + 1 if bool(real.any()) else 1
    if lo == 0 and hi == t:
        return batch
    resp = slice(0, hi)
    whole = slice(lo, p + hi)
    return replace(
        batch,
        input_ids=batch.input_ids[:, whole], attention_mask=batch.attention_mask[:, whole],
        position_ids=batch.position_ids[:, whole], response_ids=batch.response_ids[:, resp],
        response_mask=batch.response_mask[:, resp], sampler_logp=batch.sampler_logp[:, resp],
        topk_logp=batch.topk_logp[:, resp], topk_ids=batch.topk_ids[:, resp],
        action_token_mask=batch.action_token_mask[:, :, resp],
        shared_token_mask=batch.shared_token_mask[:, resp], loss_mask=batch.loss_mask[:, resp],
        position_cls=batch.position_cls[:, resp], forced_token=batch.forced_token[:, resp],
        trunk=None if batch.trunk is None else batch.trunk[:, whole],
    )  # fmt: skip


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


@dataclass(frozen=True)
class MiniBatch:
    """The rows of one optimizer step and every per-token input the loss reads for them.

    Tensors are (n, T) over the rows of `batch`; the optional ones come from the step-level
    no-grad passes (`policy.update.policy_update`). Counts are GLOBAL: the whole mini-batch on
    every data-parallel rank, so the gradient does not depend on how it is split.
    """

    batch: RolloutBatch
    """The rows (a `RolloutBatch.select` of the step's batch)."""
    advantages: Tensor
    """(n, T) token advantages (A_i, or GAE with a critic, plus the shaping λ·x_ij)."""
    old_logp: Tensor | None
    """(n, T) log π_old from the old pass; None: on-policy, π_old is the loss forward detached."""
    ref_logp: Tensor | None
    """(n, T) the frozen reference's log-probs (KL); None without a reference pass."""
    old_values: Tensor | None
    """(n, T) V_old (the critic's clip anchor); None without a critic."""
    returns: Tensor | None
    """(n, T) the critic's targets; None without a critic."""
    global_tokens: int
    """Loss tokens of the mini-batch over all ranks."""
    global_seqs: int
    """Sequences with ≥ 1 loss token of the mini-batch over all ranks."""

    def __len__(self) -> int:
        return len(self.batch)

    def select(self, rows: slice) -> MiniBatch:
        """Rows ``rows`` (a micro-batch), the global counts unchanged."""

        def part(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows]

        return MiniBatch(
            self.batch.select(rows), self.advantages[rows], part(self.old_logp),
            part(self.ref_logp), part(self.old_values), part(self.returns),
            self.global_tokens, self.global_seqs,
        )  # fmt: skip


def build_loss_batch(
    out: ForwardOut, mb: MiniBatch, needs: Needs, dp_world_size: int = 1
) -> LossBatch:
    """The stack's typed batch for one micro-batch ``mb`` and its forward ``out``: what the
    stack needs, nothing more. π_old is ``mb.old_logp``, or the forward itself detached."""
    device = out.logp.device
    rows, ref_logp = mb.batch, mb.ref_logp
    old_logp = out.logp.detach() if mb.old_logp is None else mb.old_logp
    return LossBatch(
        logp=out.logp,
        old_logp=old_logp.to(device),
        sampler_logp=rows.sampler_logp.to(device),
        advantages=mb.advantages.to(device),
        response_mask=rows.loss_mask.to(device),  # forced format tokens are outside every term
        ref_logp=ref_logp.to(device) if needs.reference and ref_logp is not None else None,
        topk_logp=rows.topk_logp.to(device) if needs.topk else None,
        topk_ids=rows.topk_ids.to(device) if needs.topk else None,
        policy_topk_logp=out.topk_logp,
        values=out.values,
        old_values=mb.old_values.to(device) if mb.old_values is not None else None,
        returns=mb.returns.to(device) if mb.returns is not None else None,
        entropy=out.entropy,
        versions=torch.zeros(len(rows), dtype=torch.long, device=device),
        global_tokens=mb.global_tokens,
        global_seqs=mb.global_seqs,
        dp_world_size=dp_world_size,
    )
