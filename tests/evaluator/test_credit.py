"""The one credit path on real data: real Redis cache, real index slice, replay evaluator."""

from __future__ import annotations

import pytest
import torch

from evaluator.actions import ActionExecutor
from evaluator.cache import ActionCache
from evaluator.credit import RolloutActions, compute_credits
from evaluator.scorers import make_scorer


@pytest.fixture()
def setup(slice_dataset, embedder, slice_index, redis_client):  # type: ignore[no-untyped-def]
    cache = ActionCache(redis_client, slice_index.version, embedder.version, 10)
    ex = ActionExecutor(embedder, slice_index, cache)
    scorer = make_scorer("replay", qrels=slice_dataset.qrels_rows("train"), k=10)
    qid = slice_dataset.split_query_ids("train")[0]
    return ex, scorer, qid, slice_dataset.queries[qid]


def test_credit_axioms_on_real_rollouts(setup) -> None:  # type: ignore[no-untyped-def]
    ex, scorer, qid, query = setup
    rollouts = [
        RolloutActions(qid, query, [query, query, "", "unrelated words about astronomy"]),
        RolloutActions(qid, query, [query + " evidence"]),
    ]
    res = compute_credits(rollouts, ex, scorer, 10, with_interaction=True, anchor_query=False)
    assert res.values.shape == (2, 16) and res.phi.shape == (2, 4)
    assert float(res.values[:, 0].abs().max()) == 0.0  # v(∅) = 0 for a metric
    torch.testing.assert_close(
        res.phi.sum(-1), res.values[:, -1] - res.values[:, 0], rtol=0, atol=1e-9
    )
    assert float(res.residual.abs().max()) <= 1e-9
    # identical rewrites are symmetric players; the empty rewrite is a null player
    assert float(res.phi[0, 0]) == pytest.approx(float(res.phi[0, 1]), abs=1e-12)
    assert float(res.phi[0, 2]) == pytest.approx(0.0, abs=1e-12)  # float64 matmul rounding
    assert float(res.singleton[0, 2]) == 0.0
    # padded actions of the second rollout carry nothing; a single player gets v(N)
    assert res.phi[1, 1:].abs().max() == 0 and res.broadcast[1, 1:].abs().max() == 0
    assert float(res.phi[1, 0]) == pytest.approx(float(res.values[1, -1]))
    assert res.interaction is not None and res.interaction.shape == (2, 4, 4)
    rec = res.record(1)
    assert rec["actions"] == [query + " evidence"] and len(rec["value_table"]) == 2
    assert rec["evaluator_name"] == "replay" and rec["index_version"] == ex.index.version


def test_batched_equals_one_by_one(setup) -> None:  # type: ignore[no-untyped-def]
    ex, scorer, qid, query = setup
    rollouts = [
        RolloutActions(qid, query, [query, "bone density vitamin", "statins"]),
        RolloutActions(qid, query, ["heart", query + " risk"]),
    ]
    together = compute_credits(rollouts, ex, scorer, 10)
    for i, r in enumerate(rollouts):
        alone = compute_credits([r], ex, scorer, 10)
        m = len(r.actions)
        torch.testing.assert_close(together.phi[i, :m], alone.phi[0, :m], rtol=0, atol=1e-12)
        torch.testing.assert_close(together.values[i, : 2**m], alone.values[0], rtol=0, atol=1e-12)


def test_second_call_hits_cache_and_reports_versions(setup) -> None:  # type: ignore[no-untyped-def]
    ex, scorer, qid, query = setup
    rollouts = [RolloutActions(qid, query, [query, "statins"])]
    first = compute_credits(rollouts, ex, scorer, 10, anchor_query=False)
    second = compute_credits(rollouts, ex, scorer, 10, anchor_query=False)
    assert (
        first.cache["misses"] == 2 and second.cache["hits"] == 2 and second.cache["status"] == "ok"
    )
    torch.testing.assert_close(first.phi, second.phi)
    assert set(second.versions) == {
        "index_version",
        "embedder_version",
        "evaluator_name",
        "evaluator_version",
    }


def test_too_many_actions_is_a_clear_error(setup) -> None:  # type: ignore[no-untyped-def]
    ex, scorer, qid, query = setup
    with pytest.raises(ValueError, match="at most 12 actions"):
        compute_credits([RolloutActions(qid, query, ["a"] * 13)], ex, scorer, 10)
    with pytest.raises(ValueError, match="at least one rollout"):
        compute_credits([], ex, scorer, 10)


def test_distinct_rows_matches_lexicographic_unique() -> None:
    from evaluator.credit import distinct_rows

    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(-1, 6, (500, 4), generator=gen)  # many repeats
    uniq, inverse = distinct_rows(rows)
    ref = torch.unique(rows, dim=0)
    assert uniq.shape == ref.shape
    assert set(map(tuple, uniq.tolist())) == set(map(tuple, ref.tolist()))
    assert torch.equal(uniq[inverse], rows)  # every row maps back to itself


# --- the query as an anchor player (docs/methods.md §1) ----------------------------------------


def test_anchor_empty_coalition_is_the_query_alone(setup) -> None:  # type: ignore[no-untyped-def]
    """v(∅) equals the replay score of the query's own top-k list; φ sums to v(N) − v(∅)."""
    ex, scorer, qid, query = setup
    rollouts = [
        RolloutActions(qid, query, ["bone density vitamin", "statins", query + " evidence", ""]),
        RolloutActions(qid, query, ["heart"]),
    ]
    res = compute_credits(rollouts, ex, scorer, 10, anchor_query=True)
    alone = ex.run([query])
    query_list = torch.from_numpy(alone.rows)[:, None, :10]  # (1, 1, k): the query's own list
    expected = float(scorer.score([qid], torch.zeros(1, 0), query_list)[0, 0])
    assert expected > 0  # the slice query retrieves a relevant abstract on its own
    torch.testing.assert_close(
        res.value_empty, torch.full((2,), expected, dtype=torch.float64), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        res.phi.sum(-1), res.values[:, -1] - res.values[:, 0], rtol=0, atol=1e-9
    )
    assert float(res.phi[0, 3]) == pytest.approx(0.0, abs=1e-12)  # the empty rewrite adds nothing
    assert res.anchor_query and res.record(0)["anchor_query"] is True


def test_anchor_equals_the_query_as_an_always_present_action(setup) -> None:  # type: ignore[no-untyped-def]
    """The anchored game equals the plain game with the query as an extra action, restricted to
    coalitions that contain it: v_anchor(S) = v_plain(S ∪ {q})."""
    ex, scorer, qid, query = setup
    rewrites = ["bone density vitamin", "statins", "heart disease risk"]
    anchored = compute_credits(
        [RolloutActions(qid, query, rewrites)], ex, scorer, 10, anchor_query=True
    )
    plain = compute_credits(
        [RolloutActions(qid, query, [*rewrites, query])], ex, scorer, 10, anchor_query=False
    )
    with_query = plain.values[0, 8:]  # bit 3 (the query) set: masks 8..15, in order of the rest
    torch.testing.assert_close(anchored.values[0], with_query, rtol=0, atol=1e-12)


def test_anchor_off_equals_the_plain_game(setup) -> None:  # type: ignore[no-untyped-def]
    ex, scorer, qid, query = setup
    rollouts = [RolloutActions(qid, query, ["statins", query])]
    off = compute_credits(rollouts, ex, scorer, 10, anchor_query=False)
    assert float(off.values[0, 0]) == 0.0 and not off.anchor_query
    assert off.record(0)["anchor_query"] is False
