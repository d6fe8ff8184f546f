"""Replay and cosine scorers: closed forms written out by hand, batching, registry."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from evaluator.scorers import (
    CosineScorer,
    QrelsTable,
    ReplayScorer,
    SetScorer,
    make_scorer,
    register_scorer,
    registered_scorers,
)

LOG2_3 = math.log2(3.0)  # discount of rank 2 is 1/log2(3); rank 3 is 1/log2(4) = 1/2

BINARY = {"q": {10: 1, 20: 1}, "other": {5: 1}}
GRADED = {"g": {1: 2, 2: 1, 3: 3}}


def _lists(*rows: list[int]) -> torch.Tensor:
    """One query, C lists → (1, C, K) int64."""
    return torch.tensor([list(r) for r in rows], dtype=torch.int64)[None]


def _score(scorer: SetScorer, qid: str, *rows: list[int], d: int = 2) -> torch.Tensor:
    return scorer.score([qid], torch.zeros(1, d), _lists(*rows))[0]


def test_ndcg_binary_hand_computed() -> None:
    scorer = ReplayScorer(QrelsTable.from_dict(BINARY), k=3)
    idcg = 1.0 + 1.0 / LOG2_3  # two relevant docs at ranks 1, 2
    got = _score(scorer, "q", [10, 5, 20], [5, 10, -1], [20, 10, 5], [7, 8, 9])
    # relevant at ranks 1 and 3: DCG = 1 + 1/2; at rank 2 only: 1/log2(3); ideal; none
    want = [(1.0 + 0.5) / idcg, (1.0 / LOG2_3) / idcg, 1.0, 0.0]
    assert got.dtype == torch.float64
    assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_recall_binary_hand_computed() -> None:
    scorer = ReplayScorer(QrelsTable.from_dict(BINARY), k=3, metric="recall")
    got = _score(scorer, "q", [10, 5, 20], [5, 10, -1], [7, 8, 9], [-1, -1, -1])
    assert_close(got, torch.tensor([1.0, 0.5, 0.0, 0.0], dtype=torch.float64))


def test_recall_denominator_is_all_relevant_not_min_r_k() -> None:
    qrels = {"q": {1: 1, 2: 1, 3: 1}}
    scorer = ReplayScorer(QrelsTable.from_dict(qrels), k=2, metric="recall")
    assert_close(_score(scorer, "q", [1, 2]), torch.tensor([2 / 3], dtype=torch.float64))


def test_ndcg_graded_hand_computed() -> None:
    scorer = ReplayScorer(QrelsTable.from_dict(GRADED), k=2)
    # list [2, 1]: gains 2^1-1 = 1 at rank 1, 2^2-1 = 3 at rank 2 → DCG = 1 + 3/log2(3)
    # ideal grades 3, 2 (truncated at K = 2): IDCG = 7 + 3/log2(3)
    want = (1.0 + 3.0 / LOG2_3) / (7.0 + 3.0 / LOG2_3)
    assert_close(_score(scorer, "g", [2, 1]), torch.tensor([want], dtype=torch.float64))
    assert_close(_score(scorer, "g", [3, 1]), torch.tensor([1.0], dtype=torch.float64))


def test_padding_is_ignored_and_rank_is_the_column() -> None:
    scorer = ReplayScorer(QrelsTable.from_dict(BINARY), k=3)
    idcg = 1.0 + 1.0 / LOG2_3
    got = _score(scorer, "q", [10, -1, 20], [10, -1, -1], [-1, -1, -1])
    want = [1.5 / idcg, 1.0 / idcg, 0.0]  # empty list (v(∅)) → 0
    assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_lists_longer_than_k_are_truncated() -> None:
    scorer = ReplayScorer(QrelsTable.from_dict(BINARY), k=2)
    got = _score(scorer, "q", [10, 5, 20, 1])  # 20 sits at rank 3 > K
    assert_close(got, torch.tensor([1.0 / (1.0 + 1.0 / LOG2_3)], dtype=torch.float64))


def test_relevance_of_another_query_does_not_count() -> None:
    scorer = ReplayScorer(QrelsTable.from_dict(BINARY), k=3)
    assert float(_score(scorer, "q", [5, 6, 7])[0]) == 0.0  # 5 is relevant for "other" only


def test_unjudged_query_raises_with_its_name_unless_allowed() -> None:
    qrels = {**BINARY, "zero_only": {3: 0}}  # only relevance-0 judgments → unjudged
    scorer = ReplayScorer(QrelsTable.from_dict(qrels), k=3)
    with pytest.raises(ValueError, match="'missing'.*'zero_only'"):
        scorer.score(["q", "missing", "zero_only"], torch.zeros(3, 2), torch.zeros(3, 1, 3).long())
    lenient = ReplayScorer(QrelsTable.from_dict(qrels), k=3, allow_unjudged=True)
    lists = torch.tensor([[[10, 3, 20]], [[10, 3, 20]]])
    got = lenient.score(["q", "missing"], torch.zeros(2, 2), lists)
    assert float(got[1, 0]) == 0.0 and float(got[0, 0]) > 0.0


@pytest.mark.parametrize("metric", ["ndcg", "recall"])
def test_batched_equals_per_list_loop_and_chunking(metric: str) -> None:
    gen = torch.Generator().manual_seed(0)
    qrels = {
        f"q{i}": {
            int(r): int(g)
            for r, g in zip(torch.randperm(30, generator=gen)[:4], [1, 2, 3, 1], strict=True)
        }
        for i in range(4)
    }
    lists = torch.stack([torch.randperm(30, generator=gen)[:5] for _ in range(4 * 7)]).view(4, 7, 5)
    lists[:, ::3, 3:] = -1  # some padded tails
    ids = [f"q{i}" for i in range(4)]
    fast = ReplayScorer(QrelsTable.from_dict(qrels), k=5, metric=metric)  # type: ignore[arg-type]
    chunked = ReplayScorer(QrelsTable.from_dict(qrels), k=5, metric=metric, chunk=3)  # type: ignore[arg-type]
    batched = fast.score(ids, torch.zeros(4, 2), lists)
    loop = torch.tensor(
        [
            [
                float(fast.score([ids[q]], torch.zeros(1, 2), lists[q : q + 1, c : c + 1])[0, 0])
                for c in range(7)
            ]
            for q in range(4)
        ],
        dtype=torch.float64,
    )
    assert_close(batched, loop, rtol=0, atol=0)
    assert_close(chunked.score(ids, torch.zeros(4, 2), lists), batched, rtol=0, atol=0)


def test_replay_version_is_a_content_hash() -> None:
    a = ReplayScorer(QrelsTable.from_dict(BINARY), k=3).version
    assert a == ReplayScorer(QrelsTable.from_dict(dict(reversed(BINARY.items()))), k=3).version
    assert a != ReplayScorer(QrelsTable.from_dict(BINARY), k=4).version
    assert a != ReplayScorer(QrelsTable.from_dict(BINARY), k=3, metric="recall").version
    assert a != ReplayScorer(QrelsTable.from_dict({**BINARY, "q": {10: 1, 21: 1}}), k=3).version


# --- cosine -----------------------------------------------------------------------------------

DOCS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.6, 0.8], [0.8, 0.6]])
Q = torch.tensor([[1.0, 0.0]])


def test_cosine_hand_computed_and_empty_is_zero() -> None:
    scorer = CosineScorer(DOCS, k=2)
    got = scorer.score(["x"], Q, _lists([0, 3], [2, 1], [-1, -1], [3, -1]))[0]
    norm = 1.0 + 1.0 / LOG2_3  # every gain = 1
    # [0, 3]: gains 1, 0.6; [2, 1]: cos −1 and 0 → 0; empty → 0; [3, pad]: 0.6 at rank 1
    want = [(1.0 + 0.6 / LOG2_3) / norm, 0.0, 0.0, 0.6 / norm]
    assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)


def test_cosine_values_in_unit_interval_and_monotone_at_rank_one() -> None:
    gen = torch.Generator().manual_seed(1)
    docs = F.normalize(torch.randn(50, 8, generator=gen), dim=-1)
    q = F.normalize(torch.randn(6, 8, generator=gen), dim=-1)
    lists = torch.stack([torch.randperm(50, generator=gen)[:5] for _ in range(6 * 4)]).view(6, 4, 5)
    scorer = CosineScorer(docs, k=5)
    values = scorer.score(list("abcdef"), q, lists)
    assert bool(((values >= 0) & (values <= 1)).all())
    cos = q @ docs.T  # (6, 50)
    better = lists.clone()
    better[:, :, 0] = cos.argmax(-1)[:, None]  # the best doc replaces whatever was at rank 1
    improved = scorer.score(list("abcdef"), q, better)
    replaced = (better[:, :, 0] != lists[:, :, 0]) & (better[:, :, 1:] != better[:, :, :1]).all(-1)
    assert bool((improved[replaced] > values[replaced]).all()) and bool(replaced.any())


def test_cosine_version_depends_on_k_and_doc_content() -> None:
    a = CosineScorer(DOCS, k=2).version
    assert a == CosineScorer(DOCS.clone(), k=2).version
    assert a != CosineScorer(DOCS, k=3).version
    assert a != CosineScorer(DOCS * 0.5, k=2).version
    assert CosineScorer(DOCS, k=2, doc_fingerprint="x").version != a


def test_out_of_range_rows_and_bad_shapes_raise() -> None:
    scorer = CosineScorer(DOCS, k=2)
    with pytest.raises(ValueError, match="n_docs"):
        scorer.score(["x"], Q, _lists([0, 99]))
    with pytest.raises(ValueError, match=r"\(Q, C, K\)"):
        scorer.score(["x"], Q, torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="query_ids"):
        scorer.score(["x", "y"], Q, _lists([0, 1]))


# --- registry / factory -------------------------------------------------------------------------


def test_make_scorer_builds_each_kind_and_lists_valid_names() -> None:
    replay = make_scorer("replay", qrels=BINARY, k=3)
    assert isinstance(replay, SetScorer) and replay.name == "replay"
    assert make_scorer("cosine", doc_emb=DOCS, k=2).name == "cosine"
    assert {"replay", "cosine", "surrogate"} <= set(registered_scorers())
    with pytest.raises(ValueError, match="unknown scorer 'bm25'; valid: cosine, replay, surrogate"):
        make_scorer("bm25", k=3)
    with pytest.raises(ValueError, match="needs qrels"):
        make_scorer("replay", k=3)
    with pytest.raises(ValueError, match="needs surrogate_path"):
        make_scorer("surrogate", doc_emb=DOCS, k=2)
    with pytest.raises(ValueError, match="already registered"):
        register_scorer("replay")(lambda spec: replay)
