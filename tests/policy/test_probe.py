"""The speed probe behind `casi estimate`: real rates on the tiny model, the weights and their
flags untouched, and an estimate that adds up from the shape's token counts."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from policy.model import build_tiny_policy
from policy.probe import (
    PROMPT_SHAPES,
    JobShape,
    Speed,
    estimate_seconds,
    head_share,
    measure_speed,
    shape_for,
)


def test_the_probe_measures_without_changing_the_model(smol_tokenizer: Any) -> None:
    model = build_tiny_policy(smol_tokenizer, seed=1, layers=2)
    model.model.embed_tokens.weight.requires_grad_(False)  # a caller's flags come back as they were
    before = {k: v.clone() for k, v in model.state_dict().items()}
    speed = measure_speed(model, 0, rows=4, prompt_tokens=16, new_tokens=4, train_tokens=32)
    assert speed.rows == 4
    assert speed.decode_row_tokens_s > 0 and speed.prefill_tokens_s > 0 and speed.train_tokens_s > 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not model.model.embed_tokens.weight.requires_grad and not model.training
    assert all(p.grad is None for p in model.parameters())


def test_the_estimate_adds_up() -> None:
    speed = Speed(decode_row_tokens_s=100.0, prefill_tokens_s=1000.0, train_tokens_s=200.0, rows=32)
    shape = JobShape(steps=2, queries=8, samples=4, eval_claims=10, evaluations=2,
                     warmstart_steps=3, warmstart_batch=8)  # fmt: skip
    parts = estimate_seconds(speed, shape)
    assert parts["warm start"] == pytest.approx(3 * 8 * 140 / 200)
    step = 32 * 77 / 100 + (62 + 8 * 18) / 1000 + (8 * 80 + 32 * 77) / 200
    assert parts["training"] == pytest.approx(2 * step)
    assert parts["evaluation"] == pytest.approx(20 * 77 / 100 + 20 * 18 / 1000)
    # the top quarter of the layers: forward 1/3 + a quarter of the backward's 2/3
    top = estimate_seconds(speed, dataclasses.replace(shape, warmstart_layers_share=0.25))
    assert top["warm start"] == pytest.approx(parts["warm start"] * (1 + 0.5) / 3)
    assert estimate_seconds(speed, JobShape()) == {"warm start": 0, "training": 0, "evaluation": 0}


def test_a_top_n_run_pays_its_layers_and_the_head(smol_tokenizer: Any) -> None:
    """params = top with the sampler's trunk: the loss forward + backward runs the top N layers
    and the output head only; decoding and evaluation cost what they did."""
    speed = Speed(decode_row_tokens_s=100.0, prefill_tokens_s=1000.0, train_tokens_s=200.0, rows=32)
    full = JobShape(steps=2, eval_claims=10, evaluations=2)
    top = dataclasses.replace(full, train_layers_share=0.25, head_share=0.2)
    a, b = estimate_seconds(speed, full), estimate_seconds(speed, top)
    train = 2 * (8 * 80 + 32 * 77) / 200
    assert a["training"] - b["training"] == pytest.approx(train * (1 - (0.2 + 0.8 * 0.25)))
    assert a["evaluation"] == b["evaluation"]
    model = build_tiny_policy(smol_tokenizer, seed=1, layers=2)
    share = head_share(model)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert 0 < share < 1
    head: Any = model.lm_head
    assert share == pytest.approx(head.weight.numel() / sum(unique.values()))
    assert head_share(torch.nn.Linear(2, 2)) == 0.0


def test_a_prompt_style_prices_its_own_tokens() -> None:
    """`casi estimate --prompt feedback`: the longer prompt and its responses, not the short
    prompt's counts; the short style is the default shape; an unknown style is refused."""
    speed = Speed(decode_row_tokens_s=100.0, prefill_tokens_s=1000.0, train_tokens_s=200.0, rows=32)
    assert shape_for("short", steps=2) == JobShape(steps=2)
    fb = shape_for("feedback", steps=2, warmstart_steps=3)
    t = PROMPT_SHAPES["feedback"]
    assert (fb.prompt_tokens, fb.response_tokens) == (t["prompt_tokens"], t["response_tokens"])
    parts = estimate_seconds(speed, fb)
    suffix = t["prompt_tokens"] - t["shared_prefix_tokens"]
    step = (32 * t["response_tokens"] / 100 + (t["shared_prefix_tokens"] + 8 * suffix) / 1000
            + (8 * t["prompt_tokens"] + 32 * t["response_tokens"]) / 200)  # fmt: skip
    assert parts["training"] == pytest.approx(2 * step)
    assert parts["warm start"] == pytest.approx(3 * 8 * t["sft_tokens"] / 200)
    with pytest.raises(ValueError, match="got 'verbose' — the styles"):
        shape_for("verbose")
