"""Prefix-cached generation (`policy.prefix`, used by the API's batcher) equals the sampler's
generation on the full prompts: same tokens, same μ up to float rounding — greedy and seeded."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from policy.prefix import build_prefix, common_prefix, generate_with_prefix
from policy.prompts import build_prompt
from policy.sampler import SamplerConfig, default_stop_ids, generate

QUERIES = ["vitamin D and bone fractures", "statins", "aspirin lowers colorectal cancer risk a lot"]


def test_common_prefix_leaves_a_suffix() -> None:
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5]]) == (1, 2)
    assert common_prefix([[1, 2, 3]]) == (1, 2)  # one prompt: all but its last token
    assert common_prefix([[1, 2], [7]]) == ()


@pytest.mark.parametrize("do_sample", [False, True])
def test_prefix_generation_equals_full_prompt_generation(
    tiny_policy: torch.nn.Module, smol_tokenizer: Any, do_sample: bool
) -> None:
    prompts = [build_prompt(smol_tokenizer, q, 3) for q in QUERIES]
    shared = common_prefix(prompts)
    assert len(shared) > 0.7 * min(len(p) for p in prompts)  # the one-shot turn is shared
    stops = default_stop_ids(smol_tokenizer, tiny_policy)
    config = SamplerConfig(do_sample=do_sample, temperature=0.8, max_new_tokens=20, seed=3)
    pad = smol_tokenizer.pad_token_id
    full = generate(tiny_policy, prompts, config, stops, pad)
    cached = generate_with_prefix(
        tiny_policy, build_prefix(tiny_policy, shared), prompts, config, stops, pad
    )
    for a, b in zip(full, cached, strict=True):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.logp, b.logp, atol=1e-4, rtol=1e-4)


def test_prompt_without_the_prefix_is_refused(
    tiny_policy: torch.nn.Module, smol_tokenizer: Any
) -> None:
    prefix = build_prefix(tiny_policy, [1, 2, 3])
    with pytest.raises(ValueError, match="prefix"):
        generate_with_prefix(tiny_policy, prefix, [[1, 2, 4, 5]], SamplerConfig(), (0,), 0)
