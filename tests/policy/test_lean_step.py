"""The lean step gives what the previous path gave, on the tiny model, float32:

- decoding into a preallocated KV cache with finished rows leaving the batch, on the sampler's
  prepacked weights, draws the same tokens from the same seed, with the same μ, top-K and
  recorded trunk;
- the teacher-forced forward with a shared prompt (the G samples of a query run their prompt
  once) and trimmed pad columns gives the same values and gradients;
- so a Trainer step gives the same loss, gradient norm and weights (float32 tolerance);
- μ still equals the teacher-forced log-prob, and forced tokens still carry log-prob 0 and no
  gradient."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import policy.forward as forward
import policy.precision as precision
import policy.sampler as sampler
from policy.forward import ValueHead, policy_forward, trimmed
from policy.model import build_tiny_policy
from policy.rollout import collate, sample_rollouts
from policy.sampler import SamplerConfig
from policy.train_config import TrainConfig
from policy.trainer import Trainer

QUERIES = ["aspirin and heart attacks", "vitamin d and bone density in the elderly", "statins"]
TOL = 1e-5


@contextmanager
def previous_path() -> Iterator[None]:
    names = [(forward, "SHARE_PROMPT"), (forward, "TRIM_PADS"), (sampler, "ROOMY_CACHE"),
             (sampler, "SHARE_PREFIX"), (sampler, "LEAVE_EVERY"), (precision, "PACK_LINEAR")]  # fmt: skip
    saved = [getattr(module, name) for module, name in names]
    for module, name in names:
        setattr(module, name, type(getattr(module, name))(0))  # False, or 0 (never leave)
    try:
        yield
    finally:
        for (module, name), value in zip(names, saved, strict=True):
            setattr(module, name, value)


@pytest.fixture(scope="module")
def model(smol_tokenizer: Any) -> Any:
    """The tiny model with an output bias towards newline and EOS (+9 nats, ~15 % a token), so
    lines and responses end at different steps, as a trained policy's do."""
    model = build_tiny_policy(smol_tokenizer, seed=7, layers=3)
    tied = model.lm_head
    head = torch.nn.Linear(tied.in_features, tied.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(tied.weight)
        head.bias.zero_()
        newline = smol_tokenizer("\n", add_special_tokens=False)["input_ids"][0]
        head.bias[[newline, smol_tokenizer.eos_token_id]] = 9.0
    model.lm_head = head
    return model


@pytest.fixture(scope="module")
def batch(model: Any, smol_tokenizer: Any) -> Any:
    config = SamplerConfig(temperature=0.8, seed=11, top_k_logprobs=6)
    rollouts = sample_rollouts(
        model, smol_tokenizer, QUERIES, 4, 3, config, format="constrained", line_cap=8
    )
    return collate(rollouts)


@pytest.mark.parametrize(
    ("fmt", "leave_every", "capture"),
    [("constrained", 8, 2), ("constrained", 1, None), ("free", 8, 2), ("free", 8, None)],
)
def test_decoding_draws_what_the_previous_loop_drew(
    model: Any,
    smol_tokenizer: Any,
    fmt: str,
    leave_every: int,
    capture: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows leave the batch (``leave_every`` 1: each as it finishes); without a trunk capture
    the prompts' common prefix is prefilled once."""
    monkeypatch.setattr(sampler, "LEAVE_EVERY", leave_every)  # 1: every finished row leaves at once
    config = SamplerConfig(temperature=0.8, seed=5, top_k_logprobs=6, max_new_tokens=30)

    def draw() -> list[Any]:
        return sample_rollouts(
            model, smol_tokenizer, QUERIES, 4, 3, config, format=fmt, line_cap=8,
            capture_layer=capture,
        )  # fmt: skip

    new = draw()
    with previous_path():
        old = draw()
    lengths = {len(r.response_ids) for r in new}
    assert len(lengths) > 1  # rows finished at different steps: some left the batch early
    for a, b in zip(new, old, strict=True):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        # fewer rows change the matmuls' blocking: float32 rounding, a few ulps relative
        assert_close(a.sampler_logp, b.sampler_logp, atol=1e-6, rtol=1e-6)
        assert_close(a.topk_logp, b.topk_logp, atol=1e-6, rtol=1e-6)
        allowed = a.topk_logp > -1e29  # ties among disallowed tokens may list any of them
        assert torch.equal(a.topk_ids[allowed], b.topk_ids[allowed])
        if capture is not None:
            assert a.trunk is not None and b.trunk is not None
            assert_close(a.trunk, b.trunk, atol=1e-5, rtol=0)
    batch = collate(new)
    with torch.no_grad():
        teacher = policy_forward(model.eval(), batch, 0.8).logp
    mask = batch.response_mask
    assert_close(teacher[mask], batch.sampler_logp[mask], atol=1e-5, rtol=0)  # μ = π


def test_greedy_decoding_is_unchanged(model: Any, smol_tokenizer: Any) -> None:
    config = SamplerConfig(do_sample=False, top_k_logprobs=3, batch_size=5)

    def draw() -> list[Any]:
        return sample_rollouts(
            model, smol_tokenizer, QUERIES * 3, 1, 4, config, format="constrained", line_cap=8
        )  # fmt: skip

    new = draw()
    with previous_path():
        old = draw()
    assert [r.response_ids for r in new] == [r.response_ids for r in old]
    for a, b in zip(new, old, strict=True):
        assert_close(a.sampler_logp, b.sampler_logp, atol=1e-6, rtol=0)


def test_trimmed_drops_only_unused_columns(batch: Any) -> None:
    part = batch.select(slice(8, 12))  # the third query: its own prompt width and lengths
    t = trimmed(part)
    assert t.input_ids.shape[1] < part.input_ids.shape[1]
    assert bool(t.attention_mask[:, 0].any()) and bool(t.response_mask[:, -1].any())
    assert int(t.attention_mask.sum()) == int(part.attention_mask.sum())  # no real token lost
    assert int(t.loss_mask.sum()) == int(part.loss_mask.sum())
    assert trimmed(t) is t  # nothing left to drop


def test_rows_of_one_prompt_share_it(batch: Any) -> None:
    def owner(rows: slice) -> list[int] | None:
        mb = trimmed(batch.select(rows))
        found = forward._prompt_owner(mb.input_ids, mb.attention_mask, mb.response_ids.shape[1])
        return None if found is None else found.tolist()

    assert owner(slice(0, 12)) == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert owner(slice(2, 9)) == [0, 0, 1, 1, 1, 1, 2]
    assert owner(slice(5, 6)) is None and owner(slice(3, 5)) is None  # nothing shared


@pytest.mark.parametrize("rows", [slice(0, 12), slice(2, 9), slice(5, 6)])
def test_shared_prompt_and_trim_equal_the_previous_forward(
    model: Any, batch: Any, rows: slice
) -> None:
    mb = batch.select(rows)  # whole groups, groups cut at both ends, a single row
    head = ValueHead(model.config.hidden_size)
    torch.nn.init.normal_(head.proj.weight)
    kw = dict(with_topk=True, with_entropy=True, value_head=head)
    model.eval()
    with torch.no_grad():
        new = policy_forward(model, mb, 0.8, **kw)
        with previous_path():
            old = policy_forward(model, mb, 0.8, **kw)
    keep, mask = mb.loss_mask, mb.response_mask
    assert_close(new.logp, old.logp, atol=TOL, rtol=0)
    assert_close(new.logp[mask], mb.sampler_logp[mask], atol=TOL, rtol=0)  # still μ
    assert bool((new.logp[mb.forced_mask] == 0).all())  # forced tokens: exactly 0
    assert_close(new.topk_logp, old.topk_logp, atol=TOL, rtol=0)
    assert_close(new.entropy[keep], old.entropy[keep], atol=TOL, rtol=1e-5)  # type: ignore[index]
    assert_close(new.values, old.values, atol=TOL, rtol=0)


def test_gradients_equal_the_previous_forward(model: Any, batch: Any) -> None:
    mb = batch.select(slice(0, 8))
    weights = torch.randn(mb.loss_mask.shape, generator=torch.Generator().manual_seed(0))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = policy_forward(model, mb, 0.8)
        (out.logp * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.train()
    new = grads()
    with previous_path():
        old = grads()
    model.zero_grad(set_to_none=True)
    assert new.keys() == old.keys() and new
    for name in new:
        assert_close(new[name], old[name], atol=1e-5, rtol=1e-4, msg=name)
    # forced tokens carry log-prob 0 and no gradient
    model.zero_grad(set_to_none=True)
    out = policy_forward(model, mb, 0.8)
    assert bool(mb.forced_mask.any()) and bool((out.logp[mb.forced_mask] == 0).all())
    (out.logp * mb.forced_mask).sum().backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0 for p in model.parameters())


def test_a_trainer_step_equals_the_previous_path(
    smol_tokenizer: Any, slice_retrieval: Any, train_scorer: Any
) -> None:
    queries = [
        (q, slice_retrieval.dataset.queries[q]) for q in list(slice_retrieval.dataset.queries)[:3]
    ]
    results, models = [], []
    for lean in (True, False):
        model = build_tiny_policy(smol_tokenizer, seed=3, layers=3)
        cfg = TrainConfig.from_preset(
            "casi", steps=2, queries=3, samples=3, n_actions=2, line_cap=6, lr=1e-2, list_k=10,
        )  # fmt: skip
        cfg = dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, micro_batch_size=4))
        trainer = Trainer(model, smol_tokenizer, cfg, slice_retrieval.executor, train_scorer)
        if lean:
            results.append(trainer.train_step(queries))
        else:
            with previous_path():
                results.append(trainer.train_step(queries))
        models.append(trainer.model)
    lean_step, old_step = results
    assert torch.equal(lean_step.batch.response_ids, old_step.batch.response_ids)  # same draws
    assert lean_step.metrics["loss"] == pytest.approx(old_step.metrics["loss"], abs=1e-5)
    assert lean_step.metrics["grad_norm"] == pytest.approx(old_step.metrics["grad_norm"], rel=1e-4)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)
