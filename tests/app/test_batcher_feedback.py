"""The API's batcher prompts a policy as it was trained: a policy whose folder records the
feedback prompt (app.training.policy_prompt) is served with each row's feedback context from the
server's context source (the game's FeedbackContext in the API), one call per distinct m, and
its rewrites are those `sample_rollouts` writes from the same prompts, greedy constrained rows
decoding with the degenerate guard as serving does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.services.policies import serving_policy
from app.training.policy_loader import LoadedPolicy
from app.training.policy_prompt import PolicyPrompt, write_prompt
from app.workers.batcher import RewriteBatcher, Row
from policy.model import build_tiny_policy, policy_version
from policy.rollout import sample_rollouts
from policy.sampler import SamplerConfig


def _served(smol_tokenizer: Any, folder: Path) -> Any:
    model = build_tiny_policy(smol_tokenizer, seed=0)
    loaded = LoadedPolicy(
        model, smol_tokenizer, policy_version(model), "tiny", "tiny", str(folder), "warmstart"
    )
    return serving_policy(loaded, "float32")


def test_a_feedback_policy_is_served_with_each_rows_context(
    smol_tokenizer: Any, tmp_path: Path
) -> None:
    write_prompt(tmp_path, PolicyPrompt("feedback", 8))
    policy = _served(smol_tokenizer, tmp_path)
    assert (policy.prompt, policy.feedback_words) == ("feedback", 8)
    calls: list[tuple[list[str], int, int]] = []

    def contexts(queries: Any, n_words: int, n_actions: int) -> list[str]:
        calls.append((list(queries), n_words, n_actions))
        return [f"{q.split()[0]} words for {n_actions}" for q in queries]

    batcher = RewriteBatcher(
        policy, max_batch=4, max_wait_s=0.05, max_queue=16, contexts=contexts
    ).start()
    try:
        rows = [Row("vitamin d bone", 2, 0.0, 16, line_cap=4), Row("aspirin cancer", 3, 0.0, 16,
                line_cap=4)]  # fmt: skip
        results, _ = batcher.submit(rows).result(timeout=120)
    finally:
        batcher.close()
    assert sorted(calls, key=lambda c: c[2]) == [
        (["vitamin d bone"], 8, 2),
        (["aspirin cancer"], 8, 3),
    ]
    for row, got in zip(rows, results, strict=True):
        want = sample_rollouts(
            policy.model, smol_tokenizer, [row.query], 1, row.n_actions,
            SamplerConfig(do_sample=False, max_new_tokens=16), prompt_style="feedback",
            format="constrained", line_cap=4,
            contexts=[f"{row.query.split()[0]} words for {row.n_actions}"],
            refuse_degenerate=True,
        )[0]  # fmt: skip
        assert [a.text for a in got.parsed.actions] == want.action_texts


def test_a_feedback_policy_without_a_context_source_fails_its_request(
    smol_tokenizer: Any, tmp_path: Path
) -> None:
    write_prompt(tmp_path, PolicyPrompt("feedback", 8))
    batcher = RewriteBatcher(
        _served(smol_tokenizer, tmp_path), max_batch=4, max_wait_s=0.01, max_queue=16
    ).start()
    try:
        with pytest.raises(RuntimeError, match="no feedback context"):
            batcher.submit([Row("aspirin", 2, 0.0, 16)]).result(timeout=60)
        assert batcher.alive
    finally:
        batcher.close()


def test_a_policy_without_a_record_is_served_oneshot(smol_tokenizer: Any, tmp_path: Path) -> None:
    assert _served(smol_tokenizer, tmp_path).prompt == "oneshot"
