"""Generation that reuses the KV cache of a shared prompt prefix (serving).

Every rewrite prompt starts with the same tokens — the system prompt and the one-shot example
turn, about 165 of the default prompt's ~180 — and only the claim at the end differs. Read
:func:`generate_with_prefix`: the prefix runs through the model ONCE (:func:`build_prefix`);
each batch copies its KV cache to the batch size, prefills only each row's suffix (layout
``[prefix | left pad | suffix]``, pads masked, positions counting attended tokens only), then
decodes exactly as `policy.sampler.generate` does (same step, same draw, same cut at the stop
token). A batch's prompt compute shrinks ~10×, which is what dominates batched serving on CPU.

The outputs are the same tokens as `generate` on the full prompts up to float rounding (the
attention sums run over a different padding layout); `tests/policy/test_prefix.py` checks it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from policy.constrain import FormatAutomaton, RowConstraints
from policy.kvcache import new_cache
from policy.sampler import (
    Generated,
    SamplerConfig,
    _step,
    check_constraints,
    common_prefix,
    decode,
    forward_kwargs,
    model_device,
    prefill_suffixes,
)

__all__ = ["PromptPrefix", "build_prefix", "common_prefix", "generate_with_prefix"]


@dataclass(frozen=True)
class PromptPrefix:
    """Token ids of a shared prefix and its KV cache for ONE row (never mutated)."""

    ids: tuple[int, ...]
    cache: Any


@torch.no_grad()
def build_prefix(model: nn.Module, ids: Sequence[int]) -> PromptPrefix:
    """Run ``ids`` (P,) through ``model`` once and keep the KV cache."""
    device = model_device(model)
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)  # (1, P)
    mask = torch.ones_like(input_ids)
    positions = torch.arange(len(ids), device=device)[None, :]
    _, cache = _step(model, forward_kwargs(model), new_cache(model), input_ids=input_ids,
                     attention_mask=mask, position_ids=positions)  # fmt: skip
    return PromptPrefix(tuple(ids), cache)


@torch.no_grad()
def generate_with_prefix(
    model: nn.Module,
    prefix: PromptPrefix,
    prompts: list[list[int]],
    config: SamplerConfig,
    stop_token_ids: tuple[int, ...],
    pad_token_id: int,
    *,
    automaton: FormatAutomaton | None = None,
    n_actions: Sequence[int] | None = None,
    refuse_degenerate: bool = False,
) -> list[Generated]:
    """One response per prompt (each must start with ``prefix.ids``), in row order;
    ``automaton`` + ``n_actions`` (one m per prompt) and ``refuse_degenerate``: as in
    `generate`."""
    check_constraints(prompts, config, automaton, n_actions, refuse_degenerate)
    p_len = len(prefix.ids)
    if any(tuple(p[:p_len]) != prefix.ids or len(p) <= p_len for p in prompts):
        raise ValueError("every prompt must start with the prefix and extend past it")
    device = model_device(model)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    stop_ids = torch.tensor(stop_token_ids, dtype=torch.long, device=device)
    size = config.batch_size or len(prompts)
    out: list[Generated] = []
    for start in range(0, len(prompts), size):
        suffixes = [p[p_len:] for p in prompts[start : start + size]]
        rows = None
        if automaton is not None and n_actions is not None:
            rows = RowConstraints(automaton, n_actions[start : start + size], refuse_degenerate)
        out.extend(_batch(model, prefix, suffixes, config, generator, stop_ids, pad_token_id, rows))
    return out


def _batch(
    model: nn.Module, prefix: PromptPrefix, suffixes: list[list[int]], config: SamplerConfig,
    generator: torch.Generator, stop_ids: Tensor, pad_id: int,
    constraint: RowConstraints | None = None,
) -> list[Generated]:  # fmt: skip
    names, rows = forward_kwargs(model), len(suffixes)
    cache = copy.deepcopy(prefix.cache)
    cache.batch_repeat_interleave(rows)  # (1, H, P, D) → (B, H, P, D) per layer
    logits, cache, attention_mask = prefill_suffixes(
        model, names, cache, len(prefix.ids), suffixes, pad_id
    )
    return decode(
        model, names, cache, logits, attention_mask, config, generator, stop_ids, pad_id, constraint
    )
