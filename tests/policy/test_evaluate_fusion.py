"""The held-out nDCG@10 is the credit game's value: lists fused at the game's depth and rule.

Bug named here: the held-out evaluation fused depth-100 lists and cut the fusion to 10. Under
``max`` that is the top 10 of the fusion of depth-10 lists, under ``rrf`` it is not (a document
at rank 30 of several lists outranks one at rank 1 of one list), so under ``rrf`` held-out
``combined`` nDCG@10 was neither the training reward v(N) nor the list CASI serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from evaluator.actions import ActionExecutor, normalize_rewrite
from evaluator.cache import ActionCache
from evaluator.credit import RolloutActions, compute_credits
from evaluator.scorers import make_scorer
from policy.evaluate import EvalConfig, EvalResult, evaluate_policy
from policy.rollout import RolloutConfig

GAME_DEPTH, RECALL_DEPTH, M = 10, 100, 2
SHAPE = EvalConfig(RolloutConfig(n_actions=M, line_cap=10))


def _players(result: EvalResult, queries: Sequence[tuple[str, str]]) -> list[RolloutActions]:
    """The evaluation's own greedy rewrites as credit-game rollouts."""
    return [
        RolloutActions(row["query_id"], text, row["rewrites"])
        for row, (_, text) in zip(result.per_query, queries, strict=True)
    ]


def _column(result: EvalResult, metric: str, i: int) -> torch.Tensor:
    """(Q,) float64: per-query ``metric`` of list i (0 query, 1 rewrites, 2 combined)."""
    return torch.tensor([row[metric][i] for row in result.per_query], dtype=torch.float64)


# --- the tiny format policy on the SciFact slice ---------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("merge", ["max", "rrf"])
def test_held_out_ndcg_is_the_game_value(
    format_policy, smol_tokenizer, slice_dataset, embedder, slice_index, redis_client, merge
) -> None:  # type: ignore[no-untyped-def]
    """Per claim: query nDCG@10 = v(∅) and combined = v(N) of the anchored game, rewrites =
    v(N) of the plain game, computed by compute_credits on the same rewrites at the game's
    depth; recall@100 is on depth-100 lists."""
    ds = slice_dataset
    qids = ds.split_query_ids("train")[:4] + ds.split_query_ids("test")
    queries = [(q, ds.queries[q]) for q in qids]
    qrels = {**ds.qrels_rows("train"), **ds.qrels_rows("test")}

    def executor(k: int) -> ActionExecutor:
        cache = ActionCache(redis_client, slice_index.version, embedder.version, k)
        return ActionExecutor(embedder, slice_index, cache, merge=merge)

    game, deep = executor(GAME_DEPTH), executor(RECALL_DEPTH)
    ndcg = make_scorer("replay", qrels=qrels, k=10)
    recall = make_scorer("replay", qrels=qrels, k=RECALL_DEPTH, metric="recall")
    result = evaluate_policy(
        format_policy, smol_tokenizer, queries, game, ndcg, recall, SHAPE, recall_executor=deep
    )
    players = _players(result, queries)
    anchored = compute_credits(players, game, ndcg, 10, n_players=M).values  # (Q, 2^M)
    plain = compute_credits(players, game, ndcg, 10, anchor_query=False, n_players=M).values
    exact: dict[str, Any] = {"rtol": 0.0, "atol": 1e-12}
    torch.testing.assert_close(_column(result, "ndcg", 0), anchored[:, 0], **exact)
    torch.testing.assert_close(_column(result, "ndcg", 1), plain[:, -1], **exact)
    torch.testing.assert_close(_column(result, "ndcg", 2), anchored[:, -1], **exact)
    assert result.metrics["combined_ndcg@10"] == pytest.approx(float(anchored[:, -1].mean()))
    # the slice holds < 100 documents: a depth-100 list is the whole corpus, recall@100 = 1
    assert len(slice_index) < RECALL_DEPTH
    torch.testing.assert_close(
        _column(result, "recall", 0), torch.ones(len(qids), dtype=torch.float64)
    )

    # the old path — fuse the depth-100 lists, cut to 10 — is v(N) of a depth-100 game: under
    # rrf it differs from the game's value on these claims, so the equality above catches it
    old = compute_credits(players, deep, ndcg, 10, n_players=M).values[:, -1]
    if merge == "max":
        torch.testing.assert_close(old, anchored[:, -1], **exact)
    else:
        assert bool((old != anchored[:, -1]).any())


# --- a constructed retriever: a document at rank 30 of every list ----------------------------

N_DOCS, SHARED, SHARED_RANK = 200, 199, 30  # SHARED: the one relevant document
Q_ID, Q_TEXT = "q", "the claim"


class FixedLists:
    """A :class:`~evaluator.retrievers.Retriever` with two hand-made depth-100 lists: the claim
    gets rows 0..98, every other text (any rewrite) rows 100..198, and both hold SHARED at rank
    SHARED_RANK; scores fall with the rank (the same in both lists)."""

    name, version, encoder_version = "fixed", "fixed-v1", "fixed-enc-v1"
    doc_ids = [str(i) for i in range(N_DOCS)]

    def __len__(self) -> int:
        return N_DOCS

    @staticmethod
    def _list(first: int) -> np.ndarray:
        rows = list(range(first, first + RECALL_DEPTH - 1))
        rows.insert(SHARED_RANK - 1, SHARED)
        return np.array(rows, dtype=np.int64)

    def retrieve(self, texts: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        claim = normalize_rewrite(Q_TEXT)
        rows = np.stack([self._list(0 if t == claim else 100)[:k] for t in texts])  # (n, k)
        scores = np.broadcast_to(1.0 - np.arange(k, dtype=np.float32) / 1000, rows.shape)
        return rows, scores.copy()


@pytest.mark.integration
@pytest.mark.parametrize(("merge", "old_ndcg"), [("max", 0.0), ("rrf", 1.0)])
def test_rrf_of_deep_lists_ranks_what_the_game_never_sees(
    tiny_policy, smol_tokenizer, redis_client, merge, old_ndcg
) -> None:  # type: ignore[no-untyped-def]
    """SHARED is at rank 30 of the claim's list and of every rewrite's: outside every depth-10
    list, so the game's v(N) and held-out combined nDCG@10 are 0. Fusing the depth-100 lists
    (the old held-out path) gives it (1 + M)/90 under rrf, above any rank-1 document (at most
    M/61): nDCG@10 = 1; under max its best score stays at rank 30: 0 at either depth."""
    retriever = FixedLists()

    def executor(k: int) -> ActionExecutor:
        cache = ActionCache(redis_client, retriever.version, retriever.encoder_version, k)
        return ActionExecutor(None, retriever, cache, merge=merge)

    game, deep = executor(GAME_DEPTH), executor(RECALL_DEPTH)
    qrels = {Q_ID: {SHARED: 1}}
    ndcg = make_scorer("replay", qrels=qrels, k=10)
    recall = make_scorer("replay", qrels=qrels, k=RECALL_DEPTH, metric="recall")
    queries = [(Q_ID, Q_TEXT)]
    result = evaluate_policy(
        tiny_policy, smol_tokenizer, queries, game, ndcg, recall, SHAPE, recall_executor=deep
    )
    assert all(normalize_rewrite(a) for a in result.per_query[0]["rewrites"])  # M real players
    assert result.per_query[0]["ndcg"] == [0.0, 0.0, 0.0]
    assert result.per_query[0]["recall"] == [1.0, 1.0, 1.0]  # SHARED is in every depth-100 list
    players = _players(result, queries)
    assert compute_credits(players, game, ndcg, 10, n_players=M).values[0, -1].item() == 0.0
    old = compute_credits(players, deep, ndcg, 10, n_players=M).values[0, -1].item()
    assert old == pytest.approx(old_ndcg, abs=1e-12)


def test_a_pooled_game_without_its_extras_is_refused_before_decoding(
    smol_tokenizer, slice_dataset, embedder, slice_index, redis_client
) -> None:  # type: ignore[no-untyped-def]
    """The pool / PoolEval mismatch was found after the greedy decode of every query and both
    fusions (minutes on a real policy); it is now found first: the model is never called."""
    ds = slice_dataset
    queries = [(q, ds.queries[q]) for q in ds.split_query_ids("test")]
    qrels = ds.qrels_rows("test")
    cache = ActionCache(redis_client, slice_index.version, embedder.version, RECALL_DEPTH)
    pool = ActionExecutor(embedder, slice_index, cache, merge="pool")

    class NeverCalled(torch.nn.Module):
        def forward(self, *args: Any, **kw: Any) -> Any:
            raise AssertionError("decoded before the game's configuration was checked")

    with pytest.raises(ValueError, match="the pooled game's evaluation needs PoolEval"):
        evaluate_policy(
            NeverCalled(), smol_tokenizer, queries, pool,
            make_scorer("replay", qrels=qrels, k=10),
            make_scorer("replay", qrels=qrels, k=RECALL_DEPTH, metric="recall"),
            SHAPE, recall_executor=pool,
        )  # fmt: skip
