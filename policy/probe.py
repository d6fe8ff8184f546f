"""How fast this machine runs the policy: a few seconds of measurement to predict a long job.

Read :func:`measure_speed`. It times the three kinds of work every job is made of, on the real
model at the real shapes, and reports rates:

- **decode**: row-tokens per second of the sampler's decode loop (``rows`` rows decoding
  together, as a training step's B·G rollouts or an evaluation batch do);
- **prefill**: prompt tokens per second of one batched forward without gradient;
- **train**: tokens per second of a forward + backward with every weight trainable (the loss
  forward of a step, the warm start's SFT step).

`estimate_seconds` turns them into the duration of a job of a given shape (a warm start, a
training run with held-out evaluations) at its prompt style's token counts (`shape_for`). The
rates are the machine's, measured now: a machine that is busy with something else gets a
longer estimate, as it should.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from policy.precision import build_sampler_model
from policy.sampler import SamplerConfig, forward_kwargs, generate
from policy.update import autocast


@dataclass(frozen=True)
class Speed:
    decode_row_tokens_s: float
    prefill_tokens_s: float
    train_tokens_s: float
    rows: int


def _timed(fn: Callable[[int, int], object], rows: int, tokens: int) -> float:
    """Seconds of ``fn(rows, tokens)``, after one warm-up call at a tiny shape (kernels, the
    allocator, lazy imports), so the probe pays each measured shape once."""
    fn(1, 4)
    t0 = time.perf_counter()
    fn(rows, tokens)
    return time.perf_counter() - t0


def measure_speed(
    model: nn.Module,
    pad_token_id: int,
    *,
    rows: int = 16,
    prompt_tokens: int = 32,
    new_tokens: int = 12,
    train_rows: int = 2,
    train_tokens: int = 64,
    precision: str = "float32",
) -> Speed:
    """Rates of decode (``rows`` rows × ``new_tokens``), prefill and forward + backward on
    ``model`` (its device), the sampler and the training forward at ``precision`` (float32 or
    bfloat16, as the job will run them); the weights are unchanged (no optimizer step, the
    gradients are dropped)."""
    device = next(model.parameters()).device
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 1000))
    gen = torch.Generator().manual_seed(0)

    def ids(n_rows: int, n_tokens: int) -> torch.Tensor:
        return torch.randint(100, min(vocab, 20000), (n_rows, n_tokens), generator=gen)

    sampler = build_sampler_model(model, precision, copy_weights=False)

    def decode(n_rows: int, n_new: int) -> None:
        config = SamplerConfig(max_new_tokens=n_new, do_sample=False, stop_token_ids=(-1,))
        generate(sampler, ids(n_rows, prompt_tokens).tolist(), config, (-1,), pad_token_id)

    # the sampler's prefill projects only the last position onto the vocabulary: so does this
    # one, or decode_s - prefill_s takes out more than decode_s holds (negative on a tiny model)
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in forward_kwargs(sampler) else {}

    def prefill(n_rows: int, n_tokens: int) -> None:
        x = ids(n_rows, n_tokens).to(device)
        sampler(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False, **last_only)

    def step(n_rows: int, n_tokens: int) -> None:
        x = ids(n_rows, n_tokens).to(device)
        with autocast(device, precision):
            out = model(input_ids=x, attention_mask=torch.ones_like(x))
        out.logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    was_training = model.training
    flags = [p.requires_grad for p in model.parameters()]
    try:
        model.eval()
        with torch.no_grad():
            decode_s = _timed(decode, rows, new_tokens)
            prefill_s = _timed(prefill, rows, prompt_tokens)
        for p in model.parameters():
            p.requires_grad_(True)
        model.train()
        train_s = _timed(step, train_rows, train_tokens)
    finally:
        for p, flag in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(flag)
        model.train(was_training)
    # decode: the prefill of the probe's prompts is in decode_s too; take it out (timing noise can
    # still put it above decode_s: then decode_s alone, a lower bound on the rate, not ~1e8)
    decode_only = decode_s - prefill_s if decode_s > prefill_s else decode_s
    return Speed(
        decode_row_tokens_s=rows * new_tokens / decode_only,
        prefill_tokens_s=rows * prompt_tokens / prefill_s,
        train_tokens_s=train_rows * train_tokens / train_s,
        rows=rows,
    )


@dataclass(frozen=True)
class JobShape:
    """What a job does, in tokens: training steps of ``queries`` × ``samples`` rollouts,
    held-out evaluations of ``eval_claims`` claims, a warm start of ``warmstart_steps`` SFT
    steps; token counts of the short prompt and of a constrained m = 4 response."""

    steps: int = 0
    queries: int = 8
    samples: int = 4
    eval_claims: int = 0
    evaluations: int = 0
    warmstart_steps: int = 0
    warmstart_batch: int = 8
    warmstart_layers_share: float = 1.0  # trained layers / all layers (the backward's share)
    train_layers_share: float = 1.0  # params = top (trunk reused): trained layers / all layers
    head_share: float = 0.0  # the output head's share of a token's forward + backward FLOPs
    prompt_tokens: int = 80
    shared_prefix_tokens: int = 62
    response_tokens: int = 77
    sft_tokens: int = 140


PROMPT_SHAPES: dict[str, dict[str, int]] = {
    "short": {"prompt_tokens": 80, "shared_prefix_tokens": 62, "response_tokens": 77,
              "sft_tokens": 140},
    # NFCorpus TRAIN queries with their 30 feedback words at m = 4 (SmolLM2's tokenizer): the
    # prompt 133 tokens, 71 of them shared; the teacher's rewrites ~47 tokens, a sampled
    # response of the start 49-52
    "feedback": {"prompt_tokens": 133, "shared_prefix_tokens": 71, "response_tokens": 51,
                 "sft_tokens": 181},
}  # fmt: skip
""":class:`JobShape`'s token counts per prompt style (`policy.prompts`), measured: what
`casi estimate --prompt` prices a job of that style at."""


def shape_for(prompt: str, **shape: Any) -> JobShape:
    """A :class:`JobShape` with the token counts of prompt style ``prompt``
    (:data:`PROMPT_SHAPES`); ValueError naming the styles that have them."""
    if prompt not in PROMPT_SHAPES:
        raise ValueError(
            f"--prompt must be one of {', '.join(PROMPT_SHAPES)}, got {prompt!r} — the styles "
            "whose token counts were measured (policy.probe.PROMPT_SHAPES)"
        )
    return JobShape(**shape, **PROMPT_SHAPES[prompt])


def estimate_seconds(speed: Speed, shape: JobShape) -> dict[str, float]:
    """Seconds of each part of ``shape`` at ``speed``: the warm start, the training steps and
    the evaluations (model loading, indexing and start-up are not included)."""
    # a forward is ~1/3 of a forward + backward; the backward of the top share of the layers
    sft_cost = (1 + 2 * shape.warmstart_layers_share) / 3
    warm = shape.warmstart_steps * shape.warmstart_batch * shape.sft_tokens * sft_cost
    rollouts = shape.queries * shape.samples
    suffix = shape.prompt_tokens - shape.shared_prefix_tokens
    step_decode = rollouts * shape.response_tokens / speed.decode_row_tokens_s
    step_prefill = (shape.shared_prefix_tokens + shape.queries * suffix) / speed.prefill_tokens_s
    # params = top with the sampler's trunk: only the trained layers run forward + backward (and
    # the output head, on the loss tokens); the frozen layers below ran once, in the sampler
    train_cost = shape.head_share + (1 - shape.head_share) * shape.train_layers_share
    step_train = (shape.queries * shape.prompt_tokens + rollouts * shape.response_tokens) * (
        train_cost / speed.train_tokens_s
    )
    claims = shape.eval_claims * shape.evaluations
    evaluation = claims * shape.response_tokens / speed.decode_row_tokens_s + (
        claims * suffix / speed.prefill_tokens_s
    )
    return {
        "warm start": warm / speed.train_tokens_s,
        "training": shape.steps * (step_decode + step_prefill + step_train),
        "evaluation": evaluation,
    }


def head_share(model: nn.Module) -> float:
    """The output head's share of the model's weights (≈ of a token's FLOPs): what a top-N
    training forward still pays besides its N layers. 0 for a model without ``lm_head``."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return 0.0
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}  # a tied head counted once
    return min(1.0, float(weight.numel()) / max(sum(unique.values()), 1))
