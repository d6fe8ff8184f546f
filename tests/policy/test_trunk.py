"""params = top reuses the sampler's hidden state below the trained layers: the teacher-forced
forward of layers L.. on the recorded trunk equals the full forward (float32, CPU), μ still
equals it, and a Trainer step with the trunk equals one that recomputes the frozen layers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from policy.forward import ValueHead, policy_forward
from policy.model import build_tiny_policy
from policy.rollout import collate, sample_rollouts
from policy.sampler import SamplerConfig
from policy.train_config import TrainConfig
from policy.trainer import Trainer

QUERIES = ["aspirin and heart attacks", "vitamin d and bone density", "statins in elderly"]
TOL = 1e-5  # float32: the sampler's KV-cached decode vs one full causal pass over the sequence


@pytest.fixture(scope="module")
def three_layers(smol_tokenizer: Any) -> Any:
    return build_tiny_policy(smol_tokenizer, seed=3, layers=3)


@pytest.mark.parametrize("fmt", ["constrained", "free"])
def test_the_upper_layers_on_the_recorded_trunk_equal_the_full_forward(
    three_layers: Any, smol_tokenizer: Any, fmt: str
) -> None:
    config = SamplerConfig(temperature=1.0, seed=5, top_k_logprobs=8, max_new_tokens=40)
    rollouts = sample_rollouts(
        three_layers, smol_tokenizer, QUERIES, 3, 3, config, format=fmt, line_cap=6,
        capture_layer=2,
    )  # fmt: skip
    assert all(
        r.trunk is not None and r.trunk.shape == (len(r.prompt_ids) + len(r.response_ids) - 1, 64)
        for r in rollouts
    )
    batch = collate(rollouts)
    assert batch.trunk_input is not None and batch.trunk_layer == 2
    full = dataclasses.replace(batch, trunk=None, trunk_layer=None)
    head = ValueHead(64)
    torch.nn.init.normal_(head.proj.weight)
    with torch.no_grad():
        a = policy_forward(
            three_layers, batch, 1.0, with_topk=True, with_entropy=True, value_head=head
        )
        b = policy_forward(
            three_layers, full, 1.0, with_topk=True, with_entropy=True, value_head=head
        )
    mask, keep = batch.response_mask, batch.loss_mask
    assert_close(a.logp[mask], b.logp[mask], atol=TOL, rtol=0)
    assert_close(a.logp[mask], batch.sampler_logp[mask], atol=TOL, rtol=0)  # still μ
    assert_close(a.topk_logp[keep], b.topk_logp[keep], atol=TOL, rtol=0)  # type: ignore[index]
    # entropy is a sum over the 49k-token vocabulary (~10 nats free): float32 relative rounding
    assert_close(a.entropy[keep], b.entropy[keep], atol=TOL, rtol=1e-5)  # type: ignore[index]
    assert_close(a.values[mask], b.values[mask], atol=TOL, rtol=0)  # type: ignore[index]
    half = batch.select(slice(2, 7))  # a micro-batch keeps its rows' trunks
    with torch.no_grad():
        part = policy_forward(three_layers, half, 1.0).logp
    assert_close(part[half.response_mask], a.logp[2:7][half.response_mask], atol=TOL, rtol=0)


def test_a_top_n_step_on_the_trunk_equals_the_recomputed_step(
    smol_tokenizer: Any, slice_retrieval: Any, train_scorer: Any
) -> None:
    queries = [
        (q, slice_retrieval.dataset.queries[q]) for q in list(slice_retrieval.dataset.queries)[:2]
    ]
    results, models = [], []
    for reuse in (True, False):
        model = build_tiny_policy(smol_tokenizer, seed=3, layers=3)
        cfg = TrainConfig.from_preset(
            "casi", steps=2, queries=2, samples=2, n_actions=2, line_cap=6, lr=1e-2,
            params="top", top_layers=1, reuse_trunk=reuse, list_k=10,
        )  # fmt: skip
        trainer = Trainer(model, smol_tokenizer, cfg, slice_retrieval.executor, train_scorer)
        assert trainer.capture_layer == (2 if reuse else None)
        results.append(trainer.train_step(queries))
        models.append(trainer.model)
    with_trunk, recomputed = results
    assert with_trunk.batch.trunk is not None and recomputed.batch.trunk is None
    assert torch.equal(with_trunk.batch.response_ids, recomputed.batch.response_ids)  # same draws
    assert with_trunk.metrics["loss"] == pytest.approx(recomputed.metrics["loss"], abs=1e-5)
    assert with_trunk.metrics["grad_norm"] == pytest.approx(
        recomputed.metrics["grad_norm"], rel=1e-4
    )
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_the_trunk_is_not_reused_where_it_would_be_wrong(
    smol_tokenizer: Any, slice_retrieval: Any, train_scorer: Any
) -> None:
    model = build_tiny_policy(smol_tokenizer, seed=3, layers=3)

    def layer(**kw: Any) -> int | None:
        cfg = TrainConfig.from_preset("casi", steps=1, queries=2, samples=2, n_actions=2, **kw)
        return Trainer(
            model, smol_tokenizer, cfg, slice_retrieval.executor, train_scorer
        ).capture_layer

    assert layer(params="top", top_layers=2) == 1
    assert layer(params="top", top_layers=3) is None  # every layer trains: nothing frozen below
    assert layer(params="full") is None and layer(params="lora", lora_rank=2) is None
