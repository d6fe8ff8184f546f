"""Token sampling with recorded log-probs (the decode loop; the draw is `policy.draw`).

Read `generate` first. The teacher-forced recompute of the same distribution is
`policy.forward.response_log_softmax` (THE teacher-forced forward; the trainer reaches it
through `policy.forward.policy_forward`).

Log-prob convention (the trainer must use the same one; `response_log_softmax` does):
    μ_t = log_softmax(logits_t / temperature)[y_t]
i.e. temperature IS part of the policy's distribution, while top-p is a truncation applied to
*sampling only*: μ is the untruncated tempered log-prob. With top_p = 1 (the default) μ is
exactly the distribution sampled from; with top_p < 1 the tokens were drawn from the truncated,
renormalized distribution and μ under-states their probability by at most log(1/top_p).
The top-K log-probs (values and ids) are taken from the same tempered distribution.

Generation is our own loop over an HF KV cache (left-padded prompts, explicit position ids),
so that sampling draws from a seeded ``torch.Generator`` (same seed and inputs → same tokens
on CPU) and μ is exactly what was sampled from, not a re-derived score.

Sampler precisions (float32, bfloat16, int8, int8_weight) are built in `policy.precision`; the
trunk a ``params = top`` run keeps of each row (``capture_layer``) is recorded by `policy.trunk`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from policy.constrain import (
    FormatAutomaton,
    RowConstraints,
    constrained_log_softmax,
    format_bias,
)
from policy.draw import draw_tokens
from policy.kvcache import decode_cache, new_cache
from policy.precision import PRECISIONS
from policy.trunk import capture_layer_input, row_trunks

FINISH_STOP = "stop"  # a stop token was sampled (it is the last response token)
FINISH_LENGTH = "length"  # max_new_tokens reached without a stop token


@dataclass(frozen=True)
class SamplerConfig:
    """How rollouts are sampled."""

    temperature: float = 1.0
    """Softmax temperature of the sampled policy (μ and π use it; docs/methods.md §0). Must be > 0."""
    top_p: float = 1.0
    """Nucleus truncation for drawing tokens only; μ stays untruncated. In (0, 1]."""
    max_new_tokens: int = 96
    """Response length cap; a response that hits it finishes with reason 'length'."""
    seed: int = 0
    """Seeds the torch.Generator that draws every token."""
    top_k_logprobs: int = 20
    """K of the recorded top-K log-probs (for the predictive-divergence mask)."""
    precision: str = "float32"
    """Sampler copy of the weights: 'float32', 'bfloat16', 'int8' (W8A8, CPU), 'int8_weight'."""
    batch_size: int | None = None
    """Rows (query × sample) generated together; None = all at once."""
    do_sample: bool = True
    """False = greedy argmax (evaluation / serving); μ is still recorded."""
    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end a response; None = the tokenizer's EOS and special tokens."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (got {self.temperature}); use do_sample=False for greedy."
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}); 1 disables it.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens}).")
        if self.top_k_logprobs < 1:
            raise ValueError(f"top_k_logprobs must be >= 1 (got {self.top_k_logprobs}).")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS} (got {self.precision!r}).")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None (got {self.batch_size}).")


@dataclass
class Generated:
    """Raw sampler output for one row (prompt)."""

    response_ids: list[int]  # (T,) including the stop token when finish_reason == 'stop'
    logp: Tensor  # (T,) float32 μ of each sampled token
    topk_logp: Tensor  # (T, K) float32
    topk_ids: Tensor  # (T, K) int64
    finish_reason: str
    trunk: Tensor | None = None
    """(p + T - 1, H): the hidden state entering layer ``capture_layer`` at every prompt position
    and every response position but the last (what the teacher-forced forward of the layers
    above needs); None unless asked for (`generate(capture_layer=...)`)."""


def model_device(model: nn.Module) -> torch.device:
    """Device of the first parameter (of ``model.module`` for a wrapper without its own)."""
    for candidate in (model, getattr(model, "module", model)):
        for tensor in candidate.parameters():
            return tensor.device
    return torch.device("cpu")


def forward_kwargs(model: nn.Module) -> set[str]:
    """Keyword arguments the model's forward accepts (through a DDP wrapper's ``module``)."""
    inner = getattr(model, "module", model)
    return set(inspect.signature(inner.forward).parameters)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(B, L) positions counting only attended tokens; pads get position 1 (HF convention)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def _step(model: nn.Module, names: set[str], cache: Any, **inputs: Any) -> tuple[Tensor, Any]:
    """One cached forward; returns last-position logits (B, V) and the cache."""
    cache_kw = "cache" if "cache" in names else "past_key_values"
    if "logits_to_keep" in names:
        inputs["logits_to_keep"] = 1
    out = model(**inputs, use_cache=True, **{cache_kw: cache})
    returned = getattr(out, "cache", None)
    if returned is None:
        returned = getattr(out, "past_key_values", None)
    return out.logits[:, -1], (cache if returned is None else returned)


def _group_size(prompts: list[list[int]]) -> int:
    """r if the rows are consecutive runs of r identical prompts (query-major sampling), else 1."""
    n = len(prompts)
    for r in range(n, 1, -1):
        if n % r == 0 and all(prompts[i] == prompts[i - i % r] for i in range(n)):
            return r
    return 1


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


SHARE_PREFIX = True
"""The prompts' common prefix (the system prompt and the template before the query, ~60 of ~80
tokens of the short prompt) is prefilled once and its cache copied to every row; False is the
previous path, every distinct prompt prefilled whole (kept for ``benchmarks/bench_train.py``).
Not with a trunk capture (`params = top`), which records the whole prompt of every row."""
MIN_SHARED_PREFIX = 8


def common_prefix(prompts: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The longest common prefix of ``prompts``, leaving every prompt ≥ 1 token of suffix."""
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    i = 0
    while i < n and all(p[i] == first[i] for p in prompts):
        i += 1
    return tuple(first[:i])


def prefill_suffixes(
    model: nn.Module, names: set[str], cache: Any, prefix_len: int, suffixes: list[list[int]],
    pad_id: int,
) -> tuple[Tensor, Any, Tensor]:  # fmt: skip
    """Prefill the rows' ``suffixes`` on a ``cache`` that already holds a shared prefix of
    ``prefix_len`` tokens in every row: (last logits (B, V), cache, attention mask (B, P + S)).
    The suffixes are left-padded, so the pads sit between prefix and suffix; the positions
    count attended tokens only, as for the whole prompt left-padded."""
    device = model_device(model)
    suffix_ids, suffix_mask = _left_pad(suffixes, pad_id, device)  # (B, S)
    prefix_mask = suffix_mask.new_ones((len(suffixes), prefix_len))
    attention_mask = torch.cat([prefix_mask, suffix_mask], dim=-1)  # (B, P + S)
    positions = position_ids_from_mask(attention_mask)[:, prefix_len:]
    logits, cache = _step(model, names, cache, input_ids=suffix_ids, attention_mask=attention_mask,
                          position_ids=positions)  # fmt: skip
    return logits, cache, attention_mask


@torch.no_grad()
def _generate_batch(
    model: nn.Module,
    prompts: list[list[int]],
    config: SamplerConfig,
    generator: torch.Generator,
    stop_ids: Tensor,
    pad_id: int,
    constraint: RowConstraints | None = None,
    capture_layer: int | None = None,
) -> list[Generated]:
    device = model_device(model)
    names = forward_kwargs(model)
    repeat = _group_size(prompts)  # G samples of one prompt: prefill it once, then copy its cache
    distinct = prompts[::repeat]
    steps = constraint.max_tokens() if constraint is not None else config.max_new_tokens
    fed: list[Tensor] = []  # the rows of every decode forward (rows leave as they finish)
    with capture_layer_input(model, capture_layer) as captured:
        room = steps + max(len(p) for p in distinct)
        cache = decode_cache(model, room) if ROOMY_CACHE else new_cache(model)
        shared = common_prefix(distinct) if capture_layer is None and SHARE_PREFIX else ()
        if len(shared) >= MIN_SHARED_PREFIX:  # the system prompt and template: once, not per row
            one = torch.tensor([list(shared)], dtype=torch.long, device=device)
            _, cache = _step(model, names, cache, input_ids=one, attention_mask=torch.ones_like(one),
                             position_ids=torch.arange(len(shared), device=device)[None])  # fmt: skip
            cache.batch_repeat_interleave(len(distinct))
            logits, cache, attention_mask = prefill_suffixes(
                model, names, cache, len(shared), [p[len(shared) :] for p in distinct], pad_id
            )
        else:
            input_ids, attention_mask = _left_pad(distinct, pad_id, device)
            logits, cache = _step(
                model,
                names,
                cache,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask),
            )
        if repeat > 1:
            logits = logits.repeat_interleave(repeat, dim=0)
            attention_mask = attention_mask.repeat_interleave(repeat, dim=0)
            cache.batch_repeat_interleave(repeat)
        out = decode(
            model, names, cache, logits, attention_mask, config, generator, stop_ids, pad_id,
            constraint, fed,
        )  # fmt: skip
    if capture_layer is not None:
        trunks = row_trunks(prompts, [len(g.response_ids) for g in out], repeat, captured, fed)
        for gen, trunk in zip(out, trunks, strict=True):
            gen.trunk = trunk
    return out


ROOMY_CACHE = True
"""Decode into a preallocated KV cache (`policy.kvcache.decode_cache`); False is the previous
path, Hugging Face's cache growing by concatenation (kept for ``benchmarks/bench_train.py``)."""
LEAVE_EVERY = 8
"""Finished rows leave the batch once they are at least 1/LEAVE_EVERY of the rows still in it
(each leave copies the cache of the rows kept, about what one concatenating step did); 0 is
the previous path: every row runs until the last one finishes."""


def decode(
    model: nn.Module,
    names: set[str],
    cache: Any,
    logits: Tensor,
    attention_mask: Tensor,
    config: SamplerConfig,
    generator: torch.Generator,
    stop_ids: Tensor,
    pad_id: int,
    constraint: RowConstraints | None = None,
    fed: list[Tensor] | None = None,
) -> list[Generated]:
    """The decode loop, after a prefill: ``logits`` (B, V) of the last prompt position, the
    ``cache`` and ``attention_mask`` (B, L) of B rows. Draws up to max_new_tokens per row,
    recording μ of each token and the top-K log-probs; rows stop at a stop token.

    ``constraint``: the rows' format automata (policy.constrain): every draw is from the
    tempered distribution renormalized over the allowed set, μ and the top-K are of that
    constrained distribution, and the length cap is the format's own (derived from m).

    Finished rows leave the batch (`LEAVE_EVERY`), so the forward runs on the rows still
    writing. The draws do not depend on it: every step draws B uniforms from ``generator`` and
    each row takes its own, so the same seed gives the same tokens with or without leaving.
    ``fed`` (if given) receives the original row indices of every forward after the prefill."""
    rows, device = attention_mask.shape[0], attention_mask.device
    steps = constraint.max_tokens() if constraint is not None else config.max_new_tokens
    k = config.top_k_logprobs
    tokens = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((rows, steps), dtype=torch.float32, device=device)
    top_v = torch.zeros((rows, steps, k), dtype=torch.float32, device=device)
    top_i = torch.zeros((rows, steps, k), dtype=torch.long, device=device)
    live = torch.arange(rows, device=device)  # batch position → original row
    finished = torch.zeros(rows, dtype=torch.bool, device=device)  # per batch position
    width = steps
    for t in range(steps):
        allowed = None
        if constraint is not None:
            cls, forced = constraint.positions(device)
            allowed = format_bias(constraint.automaton.table, cls, forced, logits.shape[-1])
        logp = constrained_log_softmax(logits.float() / config.temperature, allowed)  # (b, V)
        u = None
        if config.do_sample:  # B uniforms every step, whoever is left: the stream never shifts
            u = torch.rand((rows, 1), generator=generator, device=device, dtype=torch.float64)
            u = u[live]
        token = draw_tokens(logp, config, u)  # (b,)
        if constraint is not None and constraint.guard:
            token = constraint.refuse_degenerate(logp, token)
        token = token.masked_fill(finished, pad_id)
        values, ids = logp.topk(k, dim=-1)  # (b, K)
        writing = live[~finished]
        tokens[writing, t] = token[~finished]
        logps[writing, t] = logp.gather(-1, token[:, None]).squeeze(-1)[~finished]
        top_v[writing, t], top_i[writing, t] = values[~finished], ids[~finished]
        finished |= torch.isin(token, stop_ids)
        if bool(finished.all()):
            width = t + 1
            break
        if constraint is not None:
            constraint.advance(token.tolist())
        done = int(finished.sum())
        if LEAVE_EVERY and done and done * LEAVE_EVERY >= len(live):
            kept = (~finished).nonzero().squeeze(-1)
            live, token, attention_mask = live[kept], token[kept], attention_mask[kept]
            cache.batch_select_indices(kept)
            if constraint is not None:
                constraint.select(kept.tolist())
            finished = finished[kept]
        if fed is not None:
            fed.append(live)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(live), 1))], -1)
        logits, cache = _step(
            model,
            names,
            cache,
            input_ids=token[:, None],
            attention_mask=attention_mask,
            position_ids=(attention_mask.sum(-1, keepdim=True) - 1),
        )
    return _split_rows(
        tokens[:, :width], logps[:, :width], top_v[:, :width], top_i[:, :width], stop_ids
    )


def _split_rows(
    tokens: Tensor, logps: Tensor, top_v: Tensor, top_i: Tensor, stop_ids: Tensor
) -> list[Generated]:
    """Cut each row (T_max,) after its first stop token."""
    out = []
    is_stop = torch.isin(tokens, stop_ids).cpu()
    for row in range(tokens.shape[0]):
        hits = is_stop[row].nonzero()
        length = int(hits[0]) + 1 if len(hits) else tokens.shape[1]
        out.append(
            Generated(
                response_ids=tokens[row, :length].tolist(),
                logp=logps[row, :length].float().cpu(),
                topk_logp=top_v[row, :length].float().cpu(),
                topk_ids=top_i[row, :length].cpu(),
                finish_reason=FINISH_STOP if len(hits) else FINISH_LENGTH,
            )
        )
    return out


def default_stop_ids(tokenizer: Any, model: nn.Module | None = None) -> tuple[int, ...]:
    """EOS of the tokenizer and of the model's generation config, plus special tokens."""
    ids = {int(i) for i in tokenizer.all_special_ids}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
    return tuple(sorted(ids))


def serving_guard(config: SamplerConfig, constrained: bool) -> bool:
    """Whether the product decodes with the degenerate guard: every greedy, format-constrained
    decode it serves (`POST /v1/rewrites`, `casi rewrite`), the one kind the guard applies to."""
    return constrained and not config.do_sample


def check_constraints(
    prompts: Sequence[Sequence[int]], config: SamplerConfig, automaton: FormatAutomaton | None,
    n_actions: Sequence[int] | None, refuse_degenerate: bool,
) -> None:  # fmt: skip
    """The format arguments of a generation, checked before any work: one m per prompt, and
    the degenerate guard only where it applies (greedy, constrained)."""
    if automaton is not None and (n_actions is None or len(n_actions) != len(prompts)):
        raise ValueError("constrained decoding needs one n_actions per prompt")
    if refuse_degenerate and not serving_guard(config, automaton is not None):
        raise ValueError(
            "refuse_degenerate guards greedy, format-constrained decoding (do_sample=False, "
            "format='constrained'); sampled rollouts are refused by training's refuse_degenerate"
        )


def generate(
    sampler_model: nn.Module,
    prompts: list[list[int]],
    config: SamplerConfig,
    stop_token_ids: tuple[int, ...],
    pad_token_id: int,
    *,
    automaton: FormatAutomaton | None = None,
    n_actions: Sequence[int] | None = None,
    capture_layer: int | None = None,
    refuse_degenerate: bool = False,
) -> list[Generated]:
    """Sample one response per prompt (rows in order), batched by ``config.batch_size``.

    ``automaton`` + ``n_actions`` (one m per prompt): format-constrained decoding
    (policy.constrain); otherwise free decoding up to ``config.max_new_tokens``.
    ``refuse_degenerate`` (greedy, constrained): no line becomes a string of repeats
    (`policy.constrain.RowConstraints.refuse_degenerate`).
    ``capture_layer`` L: each row also records the hidden state entering decoder layer L
    (`Generated.trunk`), so a run that trains only the layers from L up does not recompute the
    frozen ones below (`policy.forward.response_log_softmax(trunk=...)`)."""
    check_constraints(prompts, config, automaton, n_actions, refuse_degenerate)
    device = model_device(sampler_model)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    stop_ids = torch.tensor(stop_token_ids, dtype=torch.long, device=device)
    size = config.batch_size or len(prompts)
    out: list[Generated] = []
    was_training = sampler_model.training  # the float32 sampler may be the training model itself
    sampler_model.eval()
    try:
        for start in range(0, len(prompts), size):
            chunk = prompts[start : start + size]
            rows = None
            if automaton is not None and n_actions is not None:
                rows = RowConstraints(automaton, n_actions[start : start + size], refuse_degenerate)
            out.extend(
                _generate_batch(
                    sampler_model,
                    chunk,
                    config,
                    generator,
                    stop_ids,
                    pad_token_id,
                    rows,
                    capture_layer,
                )  # fmt: skip
            )
    finally:
        sampler_model.train(was_training)
    return out
