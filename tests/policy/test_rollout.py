"""Sampler and recompute on a tiny model: μ equals the teacher-forced log π for a float32
sampler, differs (finite, measurable) for bfloat16 / int8, seeds reproduce, collate is right."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from numpy.testing import assert_allclose

from policy.forward import logprobs as recompute_logprobs
from policy.forward import policy_forward
from policy.model import build_tiny_policy
from policy.prompts import build_prompt
from policy.rollout import Rollout, collate, sample_rollouts
from policy.sampler import SamplerConfig

QUERIES = ["Vitamin D reduces the risk of cancer.", "p53 mutations", "ß-cells über 中文 claims"]
TOKENS = 12
FLOAT32_TOL = 1e-4  # KV-cached incremental vs full teacher-forced forward, float32
MISMATCH_MIN = 1e-4  # a low-precision sampler must be measurably off


def _sample(
    model: Any, tok: Any, precision: str = "float32", seed: int = 0, **kw: Any
) -> list[Rollout]:
    config = SamplerConfig(max_new_tokens=TOKENS, seed=seed, precision=precision, **kw)
    return sample_rollouts(model, tok, QUERIES, 2, 3, config, policy_version="v0")


@pytest.fixture(scope="module")
def fp32_rollouts(tiny_policy: Any, smol_tokenizer: Any) -> list[Rollout]:
    return _sample(tiny_policy, smol_tokenizer)


def test_float32_recompute_equals_sampler(tiny_policy: Any, fp32_rollouts: list[Rollout]) -> None:
    batch = collate(fp32_rollouts)
    for micro in (1, 4):  # micro-batching (and hence padding width) must not matter
        logp = recompute_logprobs(tiny_policy, batch, temperature=1.0, micro_batch_size=micro)
        assert_allclose(
            logp[batch.response_mask],
            batch.sampler_logp[batch.response_mask],
            atol=FLOAT32_TOL,
            rtol=0,
        )
    single = collate([fp32_rollouts[3]])  # no padding at all
    assert_allclose(
        recompute_logprobs(tiny_policy, single)[0],
        fp32_rollouts[3].sampler_logp,
        atol=FLOAT32_TOL,
        rtol=0,
    )


def test_temperature_is_part_of_mu(tiny_policy: Any, smol_tokenizer: Any) -> None:
    rollouts = _sample(tiny_policy, smol_tokenizer, temperature=0.7, top_p=0.9)
    batch = collate(rollouts)
    logp = recompute_logprobs(tiny_policy, batch, temperature=0.7)
    assert_allclose(
        logp[batch.response_mask], batch.sampler_logp[batch.response_mask], atol=FLOAT32_TOL, rtol=0
    )
    wrong = recompute_logprobs(tiny_policy, batch, temperature=1.0)
    assert (wrong - logp)[batch.response_mask].abs().mean() > 1e-2


@pytest.mark.parametrize("precision", ["bfloat16", "int8", "int8_weight"])
def test_low_precision_sampler_mismatch(
    tiny_policy: Any, smol_tokenizer: Any, precision: str
) -> None:
    rollouts = _sample(tiny_policy, smol_tokenizer, precision=precision)
    batch = collate(rollouts)
    logp_old = recompute_logprobs(tiny_policy, batch)  # π_old: the float32 training model
    diff = (logp_old - batch.sampler_logp)[batch.response_mask]
    mismatch = float(diff.abs().mean())
    print(
        f"\n[{precision}] mean |log pi_old - log mu| = {mismatch:.5f}, max = {float(diff.abs().max()):.5f}"
    )
    assert torch.isfinite(diff).all()
    assert mismatch > MISMATCH_MIN
    assert all(r.precision == precision for r in rollouts)


def test_same_seed_same_rollouts(
    tiny_policy: Any, smol_tokenizer: Any, fp32_rollouts: list[Rollout]
) -> None:
    again = _sample(tiny_policy, smol_tokenizer)
    other = _sample(tiny_policy, smol_tokenizer, seed=1)
    assert [r.response_ids for r in again] == [r.response_ids for r in fp32_rollouts]
    for a, b in zip(again, fp32_rollouts, strict=True):
        assert torch.equal(a.sampler_logp, b.sampler_logp) and torch.equal(a.topk_ids, b.topk_ids)
    assert [r.response_ids for r in other] != [r.response_ids for r in fp32_rollouts]


def test_topk_contains_sampled_token_logp(fp32_rollouts: list[Rollout]) -> None:
    hits = 0
    for r in fp32_rollouts:
        assert r.topk_logp.shape == r.topk_ids.shape == (len(r.response_ids), 20)
        assert (r.topk_logp[:, :-1] >= r.topk_logp[:, 1:]).all()  # sorted
        assert (r.sampler_logp <= r.topk_logp[:, 0] + 1e-6).all()
        for t, token in enumerate(r.response_ids):
            where = (r.topk_ids[t] == token).nonzero()
            if len(where):
                hits += 1
                assert float(r.topk_logp[t, int(where[0])]) == pytest.approx(
                    float(r.sampler_logp[t]), abs=1e-6
                )
            else:
                assert r.sampler_logp[t] <= r.topk_logp[t, -1] + 1e-6
    assert hits > 0


def test_recompute_topk_matches_sampler_topk(
    tiny_policy: Any, fp32_rollouts: list[Rollout]
) -> None:
    batch = collate(fp32_rollouts)
    with torch.no_grad():
        out = policy_forward(tiny_policy, batch, 1.0, with_topk=True)
    logp, at_ids = out.logp.masked_fill(~batch.response_mask, 0.0), out.topk_logp
    assert at_ids is not None
    mask = batch.response_mask
    assert at_ids.shape == batch.topk_logp.shape
    assert_allclose(at_ids[mask], batch.topk_logp[mask], atol=FLOAT32_TOL, rtol=0)
    assert_allclose(logp, recompute_logprobs(tiny_policy, batch), atol=1e-6, rtol=0)


def test_max_tokens_and_stop(fp32_rollouts: list[Rollout], smol_tokenizer: Any) -> None:
    for r in fp32_rollouts:
        assert 1 <= len(r.response_ids) <= TOKENS
        assert r.prompt_ids == build_prompt(smol_tokenizer, r.query, 3)
        if r.finish_reason == "length":
            assert len(r.response_ids) == TOKENS and r.status in ("truncated", "empty")
        else:
            assert r.response_ids[-1] in smol_tokenizer.all_special_ids
    assert [(r.query_index, r.sample_index) for r in fp32_rollouts] == [
        (q, g) for q in range(3) for g in range(2)
    ]


def test_greedy_is_seed_independent(tiny_policy: Any, smol_tokenizer: Any) -> None:
    a = _sample(tiny_policy, smol_tokenizer, seed=0, do_sample=False)
    b = _sample(tiny_policy, smol_tokenizer, seed=5, do_sample=False)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]


def test_collate_layout(smol_tokenizer: Any, fp32_rollouts: list[Rollout]) -> None:
    text = "1. vitamin d\n2. cancer risk"
    response = list(smol_tokenizer(text, add_special_tokens=False)["input_ids"]) + [
        smol_tokenizer.eos_token_id
    ]
    base = fp32_rollouts[0]
    from policy.parse import parse_actions

    parsed = parse_actions(response, smol_tokenizer, 3)
    made = Rollout(
        query=base.query,
        query_id="q0",
        query_index=0,
        sample_index=0,
        prompt_ids=base.prompt_ids[:5],
        response_ids=response,
        sampler_logp=torch.arange(len(response), dtype=torch.float32),
        topk_logp=torch.zeros(len(response), 20),
        topk_ids=torch.zeros(len(response), 20, dtype=torch.long),
        parsed=parsed,
        n_actions=3,
        policy_version="v1",
        finish_reason="stop",
        precision="float32",
        temperature=1.0,
    )
    batch = collate([base, made], max_actions=4)
    big_t = batch.response_ids.shape[1]
    assert batch.action_token_mask.shape == (2, 4, big_t)
    assert batch.input_ids.shape[1] == batch.prompt_width + big_t
    row = 1
    assert batch.attention_mask[row].sum() == 5 + len(response)
    assert batch.response_ids[row, : len(response)].tolist() == response
    assert (
        batch.position_ids[row, batch.prompt_width] == 5
    )  # first response token after 5 prompt tokens
    assert batch.action_mask[row].tolist() == [True, True, False, False]
    for j, action in enumerate(parsed.actions):
        expected = torch.zeros(big_t, dtype=torch.bool)
        expected[action.token_start : action.token_end] = True
        assert torch.equal(batch.action_token_mask[row, j], expected)
    assert torch.equal(
        batch.shared_token_mask[row] | batch.action_token_mask[row].any(0), batch.response_mask[row]
    )
    assert batch.sampler_logp[row, len(response) :].eq(0).all()
    assert batch.policy_versions == ["v0", "v1"]
    sub = batch.select([1])
    assert len(sub) == 1 and sub.policy_versions == ["v1"]


def test_recompute_with_grad(smol_tokenizer: Any, fp32_rollouts: list[Rollout]) -> None:
    model = build_tiny_policy(smol_tokenizer, seed=0, init_std=0.2)
    batch = collate(fp32_rollouts)
    logp = policy_forward(model, batch, 1.0).logp
    (logp * batch.response_mask).sum().backward()
    grad = model.get_input_embeddings().weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_draw_frequencies_and_top_p() -> None:
    """Draws follow p = (0.5, 0.3, 0.2); top_p = 0.6 keeps {0, 1} renormalized to (0.625, 0.375)."""
    from policy.draw import draw_tokens

    logp = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(6000, 3)
    for top_p, expected in ((1.0, [0.5, 0.3, 0.2]), (0.6, [0.625, 0.375, 0.0])):
        u = torch.rand((6000, 1), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        draws = draw_tokens(logp, SamplerConfig(top_p=top_p), u)
        share = torch.bincount(draws, minlength=3).double() / len(draws)
        assert_allclose(share.numpy(), expected, atol=0.025)  # ~4 sigma at n = 6000
        if expected[2] == 0.0:
            assert share[2] == 0


@pytest.mark.parametrize("vocab", [1000, 49152])
def test_two_level_draw_across_blocks_never_picks_a_zero(vocab: int) -> None:
    """The block search + in-block search draws the right frequencies over a large vocabulary
    whose mass sits in a few tokens of different blocks (one at a block's last slot, one in
    the padded tail block), and never a token of probability 0."""
    from policy.draw import draw_tokens

    support = torch.tensor([3, 255, 256, 700, vocab - 1])
    p = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    probs = torch.zeros(vocab).index_put_((support,), p)
    logp = probs.log().expand(8000, vocab)  # -inf outside the support: exp gives exactly 0
    u = torch.rand((8000, 1), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    draws = draw_tokens(logp, SamplerConfig(), u)
    assert set(draws.tolist()) <= set(support.tolist())
    share = torch.bincount(draws, minlength=vocab)[support].double() / len(draws)
    assert_allclose(share.numpy(), p.double().numpy(), atol=0.02)  # ~4 sigma at n = 8000


def test_weight_only_int8_rounds_rows_and_keeps_tied_embedding(smol_tokenizer: Any) -> None:
    from policy.precision import build_sampler_model

    model = build_tiny_policy(smol_tokenizer, seed=0, init_std=0.2)
    sampler = build_sampler_model(model, "int8_weight")
    w = model.model.layers[0].mlp.down_proj.weight  # (out, in)
    q = sampler.model.layers[0].mlp.down_proj.weight
    scale = w.abs().amax(1, keepdim=True) / 127
    assert ((q - w).abs() <= scale / 2 + 1e-7).all()
    assert_allclose((q / scale).detach(), (q / scale).round().detach(), atol=1e-3)
    assert torch.equal(sampler.get_output_embeddings().weight, model.get_output_embeddings().weight)
    assert sampler.get_output_embeddings().weight is sampler.get_input_embeddings().weight


@pytest.mark.parametrize(
    ("queries", "n_samples", "n_actions"),
    [([], 2, 2), (["aspirin"], 0, 2), (["aspirin"], 2, 0), (["aspirin"], 2, 13)],
)
def test_sample_rollouts_refuses_an_empty_or_impossible_request(
    tiny_policy: Any, smol_tokenizer: Any, queries: list[str], n_samples: int, n_actions: int
) -> None:
    """No queries or no samples was `range() arg 3 must not be zero`; m = 0 returned an empty
    response (and was decoded as m = 1 beside other rows); m above the players' cap ran."""
    with pytest.raises(ValueError, match=r"sample_rollouts needs queries, n_samples >= 1"):
        sample_rollouts(tiny_policy, smol_tokenizer, queries, n_samples, n_actions)
