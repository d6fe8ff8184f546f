"""The API's rewrite batcher never strands a request: a batch hook that fails (the metrics'
`observe_batch`) still answers the batch and keeps the worker thread, and a request submitted
once the batcher is closing is refused at once instead of waiting for a thread that is gone."""

from __future__ import annotations

from typing import Any

import pytest

from app.services.policies import serving_policy
from app.training.policy_loader import LoadedPolicy
from app.workers.batcher import Overloaded, RewriteBatcher, Row
from policy.model import build_tiny_policy, policy_version


def _batcher(smol_tokenizer: Any, on_batch: Any = None) -> RewriteBatcher:
    model = build_tiny_policy(smol_tokenizer, seed=0)
    loaded = LoadedPolicy(
        model, smol_tokenizer, policy_version(model), "tiny", "tiny", "tiny", "base"
    )
    policy = serving_policy(loaded, "float32")
    return RewriteBatcher(policy, max_batch=4, max_wait_s=0.01, max_queue=16, on_batch=on_batch)


def test_a_failing_batch_hook_neither_strands_the_batch_nor_the_thread(smol_tokenizer: Any) -> None:
    calls: list[int] = []

    def hook(rows: int, waits: list[float]) -> None:
        calls.append(rows)
        raise RuntimeError("the metrics backend is down")

    batcher = _batcher(smol_tokenizer, hook).start()
    try:
        row = Row("vitamin d and bone density", 2, 0.0, 16, line_cap=5)
        for _ in range(2):  # the second request is served by the same, living thread
            results, info = batcher.submit([row]).result(timeout=120)
            assert len(results) == 1 and info["batch_rows"] == 1.0
        assert calls == [1, 1] and batcher.alive
    finally:
        batcher.close()


def test_a_request_after_close_is_refused_at_once(smol_tokenizer: Any) -> None:
    batcher = _batcher(smol_tokenizer).start()
    batcher.close()
    assert not batcher.alive
    with pytest.raises(Overloaded, match="shutting down"):
        batcher.submit([Row("aspirin", 2, 0.0, 16)])
    assert batcher.waiting_rows == 0
