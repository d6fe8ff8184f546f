"""Format-constrained decoding (docs/methods.md, format-constrained policy): every sample is an
m-player game by construction, μ is the constrained teacher-forced log-prob, forced tokens are
log-prob 0 and outside every loss term."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from numpy.testing import assert_allclose

from policy.constrain import (
    CLS_FIRST,
    CLS_FORCED,
    CLS_MID_EOS,
    CLS_MID_NEWLINE,
    CLS_VISIBLE,
    automaton_for,
    trace,
)
from policy.forward import MiniBatch, build_loss_batch, policy_forward
from policy.losses.presets import load_preset
from policy.losses.stack import LossStack
from policy.model import build_tiny_policy
from policy.parse import STATUS_OK, normalize_action_text, parse_actions
from policy.rollout import collate, sample_rollouts
from policy.sampler import SamplerConfig, default_stop_ids

QUERIES = ["Vitamin D reduces the risk of cancer.", "p53 mutations", "ß-cells über 中文 claims"]
LINE_CAP = 5  # short lines keep 1,000 samples of an untrained model cheap
TF_TOL = 1e-6  # float32, CPU: sampler (KV cache) vs teacher-forced, default-init tiny model


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_automaton_classes_and_trace(smol_tokenizer: Any) -> None:
    auto = automaton_for(smol_tokenizer, LINE_CAP)
    assert automaton_for(smol_tokenizer, LINE_CAP) is auto  # built once per tokenizer
    nl, eos = auto.newline_id, auto.eos_id
    table = auto.table
    assert not table[CLS_FIRST, nl] and not table[CLS_VISIBLE, nl] and table[CLS_MID_NEWLINE, nl]
    assert table[CLS_MID_EOS, eos] and not table[CLS_MID_NEWLINE, eos]
    for special in smol_tokenizer.all_special_ids:
        assert not table[CLS_FIRST : CLS_MID_NEWLINE + 1, special].any()
    texts = smol_tokenizer.batch_decode([[i] for i in range(len(smol_tokenizer))])
    for i in table[CLS_MID_NEWLINE].nonzero().flatten().tolist():
        if i != nl:
            assert "\n" not in texts[i] and "\ufffd" not in texts[i]
    for i in table[CLS_FIRST].nonzero().flatten().tolist()[:500]:
        assert texts[i][0] in " \t"
    # "1. aspirin\n2. 5 mg" + EOS: markers forced, " " then a visible token, the end tokens
    ids = _encode(smol_tokenizer, "1. aspirin\n2. 5 mg") + [eos]
    tr = trace(auto, ids, 2)
    assert tr.valid
    # tokens: "1" "." " aspirin" "\n" "2" "." " " "5" " mg" EOS
    assert [i for i, c in enumerate(tr.cls) if c == CLS_FORCED] == [0, 1, 4, 5]
    assert tr.cls[2] == CLS_FIRST and tr.cls[3] == CLS_MID_NEWLINE
    assert tr.cls[6] == CLS_FIRST and tr.cls[7] == CLS_VISIBLE  # " " then "5"
    assert tr.cls[8] == CLS_MID_EOS and tr.cls[9] == CLS_MID_EOS
    # what the format forbids: an empty line, a third line, no marker
    assert not trace(auto, _encode(smol_tokenizer, "1.\n2. x") + [eos], 2).valid
    assert not trace(auto, _encode(smol_tokenizer, "1. a\n2. b\n3. c") + [eos], 2).valid
    assert not trace(auto, _encode(smol_tokenizer, "aspirin") + [eos], 1).valid
    # the cap: after LINE_CAP content tokens the end is forced
    long_line = _encode(smol_tokenizer, "1." + " a" * LINE_CAP) + [eos]
    tr = trace(auto, long_line, 1)
    assert tr.valid and tr.cls[-1] == CLS_FORCED and tr.forced[-1] == eos
    assert auto.max_response_tokens(2) == 2 + LINE_CAP + 1 + 2 + LINE_CAP + 1


def _check_samples(model: Any, tok: Any, n_per_m: int, seed: int) -> int:
    auto = automaton_for(tok, LINE_CAP)
    stops = default_stop_ids(tok, model)
    checked = 0
    for m in (1, 3, 4):
        groups = max(1, n_per_m // len(QUERIES))
        config = SamplerConfig(temperature=1.0, seed=seed + m, batch_size=128)
        rollouts = sample_rollouts(
            model, tok, QUERIES, groups, m, config, format="constrained", line_cap=LINE_CAP
        )
        for r in rollouts:
            assert r.status == STATUS_OK, (m, r.parsed.text)
            assert len(r.actions) == m and all(a.text for a in r.actions)
            assert len(r.response_ids) <= auto.max_response_tokens(m)
            assert r.finish_reason == "stop" and r.response_ids[-1] in stops
            for a in r.actions:  # the spans are exact
                span = tok.decode(r.response_ids[a.token_start : a.token_end])
                assert normalize_action_text(span) == a.text
            again = parse_actions(r.response_ids, tok, m, stop_token_ids=stops)
            assert again.status == STATUS_OK and len(again.actions) == m
            checked += 1
    return checked


@pytest.mark.parametrize("weights", ["tiny", "random"])
def test_thousand_constrained_samples_are_full_games(
    weights: str, tiny_policy: Any, smol_tokenizer: Any
) -> None:
    """1,000+ samples at temperature 1 from the tiny test model and from random weights."""
    model = tiny_policy if weights == "tiny" else build_tiny_policy(smol_tokenizer, seed=7)
    assert _check_samples(model, smol_tokenizer, 336, seed=11) >= 1000


@pytest.fixture(scope="module")
def default_init(smol_tokenizer: Any) -> Any:
    return build_tiny_policy(smol_tokenizer, seed=3)  # default init: float32 logits stay exact


@pytest.fixture(scope="module")
def constrained_rollouts(default_init: Any, smol_tokenizer: Any) -> list[Any]:
    config = SamplerConfig(temperature=1.0, seed=5, top_k_logprobs=8)
    return sample_rollouts(
        default_init, smol_tokenizer, QUERIES, 3, 3, config, format="constrained", line_cap=6
    )


def test_mu_equals_constrained_teacher_forced(
    default_init: Any, constrained_rollouts: list[Any]
) -> None:
    batch = collate(constrained_rollouts)
    with torch.no_grad():
        out = policy_forward(default_init, batch, 1.0, with_topk=True)
    mask = batch.response_mask
    assert_allclose(out.logp[mask], batch.sampler_logp[mask], atol=TF_TOL, rtol=0)
    keep = batch.loss_mask
    assert_allclose(out.topk_logp[keep], batch.topk_logp[keep], atol=TF_TOL, rtol=0)
    forced = batch.forced_mask
    assert forced.any() and (keep | forced).eq(mask).all()
    assert torch.equal(out.logp[forced], torch.zeros(int(forced.sum())))  # exactly 0
    assert torch.equal(batch.sampler_logp[forced], torch.zeros(int(forced.sum())))
    # the free policy gives the same tokens a different (unrenormalized) probability
    free = collate([dataclasses.replace(r, automaton=None) for r in constrained_rollouts])
    with torch.no_grad():
        free_logp = policy_forward(default_init, free, 1.0).logp
    assert (free_logp[keep] < out.logp[keep] - 1e-4).any()
    assert (free_logp[keep] <= out.logp[keep] + TF_TOL).all()  # renormalizing never lowers


def _grads(model: Any, batch: Any, noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Gradient of the casi stack's loss; ``noise`` (B, T, V) added to the response logits."""
    model.zero_grad(set_to_none=True)
    stack = LossStack(load_preset("casi"))
    handle = None
    if noise is not None:
        t = noise.shape[1]

        def hook(_mod: Any, _inp: Any, output: torch.Tensor) -> torch.Tensor:
            if output.dim() == 2:  # the head scored the loss positions only: (N, V), row-major
                return output + noise[batch.loss_mask]
            out = output.clone()
            out[:, -(t + 1) : -1] = out[:, -(t + 1) : -1] + noise
            return out

        handle = model.lm_head.register_forward_hook(hook)
    try:
        out = policy_forward(model, batch, 1.0, with_topk=True, with_entropy=True)
    finally:
        if handle is not None:
            handle.remove()
    adv = torch.linspace(-1, 1, len(batch))[:, None].expand_as(out.logp).contiguous()
    mb = MiniBatch(
        batch, adv, old_logp=batch.sampler_logp, ref_logp=batch.sampler_logp, old_values=None,
        returns=None, global_tokens=int(batch.loss_mask.sum()), global_seqs=len(batch),
    )  # fmt: skip
    lb = build_loss_batch(out, mb, stack.needs)
    loss, _ = stack(lb)
    loss.backward()  # type: ignore[no-untyped-call]
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_forced_tokens_carry_no_gradient(
    default_init: Any, constrained_rollouts: list[Any]
) -> None:
    model = copy.deepcopy(default_init).float()
    batch = collate(constrained_rollouts)
    base = _grads(model, batch, None)
    vocab = model.config.vocab_size
    noise = torch.randn((len(batch), batch.response_ids.shape[1], vocab)) * 5.0
    noise = noise * batch.forced_mask[..., None]  # perturb the logits of forced positions only
    perturbed = _grads(model, batch, noise)
    assert base.keys() == perturbed.keys() and base
    for name in base:
        assert_allclose(perturbed[name], base[name], atol=1e-7, rtol=1e-6, err_msg=name)
    # and the same perturbation at a free position does move the gradient
    free_noise = torch.randn_like(noise) * batch.loss_mask[..., None]
    moved = _grads(model, batch, free_noise)
    assert any(not torch.allclose(moved[n], base[n], atol=1e-6) for n in base)


def test_a_tokenizer_whose_tokens_decode_without_their_space_is_refused() -> None:
    """A SentencePiece-style decoder drops a token's leading space when it is decoded alone, so
    no token could begin a rewrite: every logit was masked, the constrained distribution became
    uniform over the vocabulary and `collate` failed much later. Now one clear error."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from policy.constrain import FormatAutomaton

    vocab = {"<eos>": 0, "\n": 1, "▁aspirin": 2, "▁mg": 3, "1": 4, ".": 5, "<unk>": 6}
    base = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace()
    base.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=base, eos_token="<eos>", unk_token="<unk>")
    assert tok.batch_decode([[2]]) == ["aspirin"]  # the space is gone
    with pytest.raises(ValueError, match="cannot use format='constrained'.*use format='free'"):
        FormatAutomaton(tok, LINE_CAP)
