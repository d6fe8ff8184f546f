"""Several evaluators on the same coalition lists in one credit call (what the audit needs):
the extra evaluator's game equals a separate call's, from ONE cached retrieval batch."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from evaluator.actions import ActionExecutor
from evaluator.cache import ActionCache
from evaluator.credit import EvaluatorCredit, RolloutActions, compute_credits
from evaluator.scorers import make_scorer


@pytest.fixture()
def setup(slice_dataset, embedder, slice_index, redis_client):  # type: ignore[no-untyped-def]
    cache = ActionCache(redis_client, slice_index.version, embedder.version, 10)
    ex = ActionExecutor(embedder, slice_index, cache)
    replay = make_scorer("replay", qrels=slice_dataset.qrels_rows("train"), k=10)
    cosine = make_scorer("cosine", doc_emb=torch.from_numpy(slice_index.embeddings), k=10)
    qids = slice_dataset.split_query_ids("train")[:2]
    texts = [slice_dataset.queries[q] for q in qids]
    rollouts = [
        RolloutActions(qids[0], texts[0], [texts[0], "vitamin D bone density", "statins"]),
        RolloutActions(qids[0], texts[0], ["heart failure", texts[0] + " evidence"]),
        RolloutActions(qids[1], texts[1], [texts[1], "gene expression", "", "mouse model"]),
    ]
    return ex, replay, cosine, rollouts


@pytest.mark.parametrize("anchor", [True, False])
def test_extra_scorer_equals_its_own_call_from_one_retrieval(setup, anchor: bool) -> None:  # type: ignore[no-untyped-def]
    ex, replay, cosine, rollouts = setup

    def lookups(**kwargs) -> int:  # type: ignore[no-untyped-def]
        before = ex.cache.stats.as_dict()
        compute_credits(rollouts, ex, cosine, 10, anchor_query=anchor, **kwargs)
        after = ex.cache.stats.as_dict()
        return int(after["hits"] + after["misses"] - before["hits"] - before["misses"])

    # one retrieval batch whatever the number of evaluators
    assert lookups(extra_scorers=[replay]) == lookups() > 0
    both = compute_credits(rollouts, ex, cosine, 10, anchor_query=anchor, extra_scorers=[replay])
    alone = compute_credits(rollouts, ex, replay, 10, anchor_query=anchor)
    extra = both.extra["replay"]
    assert isinstance(extra, EvaluatorCredit) and extra.version == replay.version
    for name in ("values", "phi", "singleton", "leave_one_out", "broadcast", "residual"):
        assert_close(getattr(extra, name), getattr(alone, name), rtol=0, atol=0)
    # the main evaluator's game is untouched by the extra one
    cos_alone = compute_credits(rollouts, ex, cosine, 10, anchor_query=anchor)
    assert_close(both.values, cos_alone.values, rtol=0, atol=1e-12)
    assert both.versions["evaluator_name"] == "cosine" and set(both.extra) == {"replay"}
    assert float(extra.residual.abs().max()) <= 1e-9


def test_no_extra_scorers_by_default_and_names_must_differ(setup) -> None:  # type: ignore[no-untyped-def]
    ex, replay, cosine, rollouts = setup
    assert compute_credits(rollouts, ex, replay, 10).extra == {}
    with pytest.raises(ValueError, match="distinct names"):
        compute_credits(rollouts, ex, replay, 10, extra_scorers=[replay])
    with pytest.raises(ValueError, match="distinct names"):
        compute_credits(rollouts, ex, replay, 10, extra_scorers=[cosine, cosine])
