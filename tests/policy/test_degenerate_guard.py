"""Greedy decoding's guard against degenerate rewrites (docs/methods.md §1.10): a tiny policy
taught to answer with strings of repeats writes them greedily, and with ``refuse_degenerate``
it writes none: each line is the same as unguarded up to the token that would have made it
degenerate, and there it takes the best-ranked token that does not (or ends the line)."""

from __future__ import annotations

from typing import Any

import pytest

from evaluator.text import degenerate
from policy.constrain import automaton_for
from policy.model import build_tiny_policy
from policy.parse import STATUS_OK
from policy.rollout import sample_rollouts
from policy.sampler import SamplerConfig, default_stop_ids, generate
from policy.warmstart import WarmstartExample, warmstart

M, LINE_CAP = 2, 16
TAUGHT = {  # query -> the answer the policy memorises: one repeat, one run of digits
    "acute kidney injury": "1. acute acute acute acute\n2. renal failure outcomes",
    "p53 mutations": "1. p53 tumour suppressor\n2. 5 1234567 codon",
}


@pytest.fixture(scope="module")
def repeater(smol_tokenizer: Any) -> Any:
    model = build_tiny_policy(smol_tokenizer, seed=0)
    examples = [WarmstartExample(query=q, n_actions=M, answer=a) for q, a in TAUGHT.items()]
    warmstart(model, smol_tokenizer, examples, epochs=150, lr=1e-2, batch_size=len(examples))
    return model


def _greedy(model: Any, tok: Any, guard: bool) -> list[Any]:
    config = SamplerConfig(do_sample=False, top_k_logprobs=20)
    return sample_rollouts(
        model, tok, list(TAUGHT), 1, M, config, format="constrained", line_cap=LINE_CAP,
        refuse_degenerate=guard,
    )  # fmt: skip


def test_the_guard_refuses_what_greedy_decoding_writes(repeater: Any, smol_tokenizer: Any) -> None:
    plain = _greedy(repeater, smol_tokenizer, guard=False)
    assert [[a.text for a in r.actions] for r in plain] == [
        a.replace("1. ", "").replace("2. ", "").split("\n") for a in TAUGHT.values()
    ], "the policy writes what it was taught (the guard's test needs its repeats)"
    assert [degenerate(a.text) for r in plain for a in r.actions] == [True, False, False, True]

    guarded = _greedy(repeater, smol_tokenizer, guard=True)
    for before, after in zip(plain, guarded, strict=True):
        assert after.status == STATUS_OK and len(after.actions) == M
        assert not any(degenerate(a.text) for a in after.actions), after.parsed.text
        ids, old = after.response_ids, before.response_ids
        t = next(i for i, (a, b) in enumerate(zip(ids, old, strict=False)) if a != b)
        # up to the refused token, the same tokens; there, the best-ranked token whose line is
        # not degenerate (the recorded top 20 of the constrained distribution, best first)
        line = smol_tokenizer.decode(ids[:t]).split("\n")[-1]
        content = line.split(".", 1)[1]
        assert degenerate((content + smol_tokenizer.decode([old[t]])).strip())
        ranked = after.topk_ids[t].tolist()
        assert ranked[0] == old[t]
        auto = automaton_for(smol_tokenizer, LINE_CAP)
        ends = (auto.newline_id, auto.eos_id)
        best = next(
            c for c in ranked
            if c in ends or not degenerate((content + smol_tokenizer.decode([c])).strip())
        )  # fmt: skip
        assert ids[t] == best
    assert guarded[0].actions[0].text.startswith("acute acute")  # kept until the third
    assert guarded[1].actions[0].text == plain[1].actions[0].text  # lines before: untouched
    assert guarded[1].actions[1].text.startswith("5 12345")  # five digits, not six


def test_the_guard_leaves_clean_lines_alone(tiny_policy: Any, smol_tokenizer: Any) -> None:
    """Greedy lines that are never degenerate come out token for token the same."""
    plain = _greedy(tiny_policy, smol_tokenizer, guard=False)
    guarded = _greedy(tiny_policy, smol_tokenizer, guard=True)
    for before, after in zip(plain, guarded, strict=True):
        if not any(degenerate(a.text) for a in before.actions):
            assert after.response_ids == before.response_ids
        assert not any(degenerate(a.text) for a in after.actions)


def test_the_guard_is_for_greedy_constrained_decoding(repeater: Any, smol_tokenizer: Any) -> None:
    stops = default_stop_ids(smol_tokenizer, repeater)
    prompt = [list(smol_tokenizer("x", add_special_tokens=False)["input_ids"])]
    auto = automaton_for(smol_tokenizer, LINE_CAP)
    with pytest.raises(ValueError, match="greedy, format-constrained"):
        generate(repeater, prompt, SamplerConfig(), stops, 0, automaton=auto, n_actions=[M],
                 refuse_degenerate=True)  # fmt: skip
    with pytest.raises(ValueError, match="greedy, format-constrained"):
        generate(repeater, prompt, SamplerConfig(do_sample=False), stops, 0,
                 refuse_degenerate=True)  # fmt: skip


def test_served_greedy_rewrites_are_guarded(repeater: Any, smol_tokenizer: Any) -> None:
    """`/v1/rewrites` and `casi rewrite` generate through `generate_rows`: a greedy request is
    decoded with the guard, a sampled one as the policy writes (serving then plays a degenerate
    rewrite as an empty action, test_pool_rewrites)."""
    from app.workers.batcher import Row, ServingPolicy, generate_rows

    stops = default_stop_ids(smol_tokenizer, repeater)
    policy = ServingPolicy(
        model=repeater, sampler_model=repeater, tokenizer=smol_tokenizer, version="repeater",
        name="repeater", path="", stop_ids=stops, pad_id=stops[0],
    )  # fmt: skip
    rows = [Row(q, M, 0.0, 64, line_cap=LINE_CAP) for q in TAUGHT]
    served = generate_rows(policy, rows, max_batch=8)
    assert [r.parsed.status for r in served] == [STATUS_OK, STATUS_OK]
    texts = [a.text for r in served for a in r.parsed.actions]
    assert texts == [a.text for r in _greedy(repeater, smol_tokenizer, True) for a in r.actions]
    assert not any(map(degenerate, texts))


def test_no_token_is_degenerate_alone(smol_tokenizer: Any) -> None:
    """The guard cannot end a line before its first visible character; it needs no such end,
    as no token of the tokenizer makes a degenerate action on its own."""
    texts = smol_tokenizer.batch_decode(
        [[i] for i in range(len(smol_tokenizer))], clean_up_tokenization_spaces=False
    )
    assert not [t for t in texts if degenerate(t.strip())]
