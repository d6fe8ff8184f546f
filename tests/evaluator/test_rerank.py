"""The served second stage (evaluator.rerank): BM25 of the expanded query over a pool, against
scores computed by hand from bm25s's ``lucene`` formula on a five-document corpus."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from evaluator.bm25 import BM25Index, BM25Params, build_or_load_bm25
from evaluator.corpus import Document
from evaluator.rerank import DEFAULT_QUERY_WEIGHT, PoolReranker, expansion_weights

# after tokenization (lower-cased, stopwords and 1-letter tokens dropped, no stemming):
DOCS = [
    Document("d0", "", "Apple and banana"),  # apple banana            |d| = 2
    Document("d1", "", "apple, apple: cherry"),  # apple apple cherry  |d| = 3
    Document("d2", "", "the banana cherry cherry date"),  # banana cherry cherry date  |d| = 4
    Document("d3", "", "date elderberry"),  # date elderberry          |d| = 2
    Document("d4", "", "a fig"),  # fig                                |d| = 1
]
N, AVGDL = 5, (2 + 3 + 4 + 2 + 1) / 5  # 2.4
LENGTH = [2, 3, 4, 2, 1]
TF = [  # tf(w, d) per row
    {"apple": 1, "banana": 1},
    {"apple": 2, "cherry": 1},
    {"banana": 1, "cherry": 2, "date": 1},
    {"date": 1, "elderberry": 1},
    {"fig": 1},
]
DF = {"apple": 2, "banana": 2, "cherry": 2, "date": 2, "elderberry": 1, "fig": 1}


def bm25(word: str, row: int, k1: float = 1.5, b: float = 0.75) -> float:
    """bm25s's ``lucene`` variant (CASI's BM25Params: method "lucene", k1 1.5, b 0.75):
    idf = ln(1 + (N − df + 0.5) / (df + 0.5)), tf part = tf / (tf + k1 · (1 − b + b·|d|/avgdl))
    (no (k1 + 1) factor: it scales every score alike)."""
    tf = TF[row].get(word, 0)
    idf = math.log(1 + (N - DF[word] + 0.5) / (DF[word] + 0.5))
    return idf * tf / (tf + k1 * (1 - b + b * LENGTH[row] / AVGDL))


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    built, _ = build_or_load_bm25(DOCS, Path(tmp_path_factory.mktemp("rerank")))
    assert built.params == BM25Params() and built.params.method == "lucene"
    return built


def test_the_hand_formula_is_bm25s_lucene(index: BM25Index) -> None:
    # idf of a word in 2 of 5 documents: ln(1 + 3.5/2.5) = ln 2.4
    assert math.isclose(bm25("apple", 0) / (1 / (1 + 1.5 * (0.25 + 0.75 * 2 / 2.4))), math.log(2.4))
    rows, scores = index.retrieve(["apple cherry"], 5)
    expected = {r: bm25("apple", r) + bm25("cherry", r) for r in range(5)}
    for row, score in zip(rows[0], scores[0], strict=True):
        if row >= 0:
            assert score == pytest.approx(expected[row], abs=1e-6)


def test_expanded_query_scores_and_ranks_the_pool_by_hand(index: BM25Index) -> None:
    # λ = 0.5: apple 0.5 · 1/1; the rewrites' tokens cherry, date, cherry: cherry 0.5 · 2/3,
    # date 0.5 · 1/3
    theta = {"apple": 0.5, "cherry": 1 / 3, "date": 1 / 6}
    assert expansion_weights(["apple"], ["cherry", "date", "cherry"], 0.5) == pytest.approx(theta)
    pool = np.array([[4, 0, 1, -1, 2, 1]])  # repeats and padding; d3 (date) is not in the pool
    rows, scores = PoolReranker(index, 0.5).rerank(["Apple"], [["cherry", "date cherry"]], pool)
    expected = {r: sum(w * bm25(word, r) for word, w in theta.items()) for r in (0, 1, 2, 4)}
    assert expected[4] == 0.0 and expected[1] > expected[0] > expected[2] > 0  # 0.336, 0.189, 0.182
    assert rows.tolist() == [[1, 0, 2, 4, -1, -1]]
    assert rows.dtype == np.int64 and scores.dtype == np.float32
    np.testing.assert_allclose(scores[0, :4], [expected[r] for r in (1, 0, 2, 4)], atol=1e-6)
    assert np.isneginf(scores[0, 4:]).all()
    # by hand, to 1e-6: d1 = 0.5·ln2.4·2/(2 + 1.5·(0.25 + 0.75·3/2.4)) + 1/3·ln2.4·1/(1 + …)
    assert scores[0, 0] == pytest.approx(0.3364540, abs=1e-6)


def test_a_document_outside_the_pool_never_appears_and_ties_rank_the_smaller_row(
    index: BM25Index,
) -> None:
    reranker = PoolReranker(index, 0.0)  # the rewrites alone
    rows, scores = reranker.rerank(["zebra"], [["elderberry date"]], np.array([[4, 1, 0, -1]]))
    assert 3 not in rows.tolist()[0]  # d3 holds both words but is not in the pool
    assert rows.tolist() == [[0, 1, 4, -1]] and (scores[0, :3] == 0).all()  # all tie at 0


def test_a_batch_pads_each_query_and_an_all_padding_pool_row_gives_padding(
    index: BM25Index,
) -> None:
    pool = np.array([[0, 1, 2, 3, 4], [-1, -1, -1, -1, -1], [3, -1, 3, -1, -1]])
    rows, scores = PoolReranker(index).rerank(
        ["banana", "apple", "date"], [["cherry"], [], []], pool
    )
    assert rows[1].tolist() == [-1] * 5 and np.isneginf(scores[1]).all()
    assert rows[2].tolist() == [3, -1, -1, -1, -1]
    assert set(rows[0].tolist()) == {0, 1, 2, 3, 4}


def test_weight_zero_on_the_expansion_is_the_querys_own_bm25_order(index: BM25Index) -> None:
    query = "cherry banana apple apple"
    own_rows, own_scores = index.retrieve([query], 5)
    hits = own_rows[0][own_rows[0] >= 0]
    pool = np.array([[4, 3, 2, 1, 0]])
    rows, scores = PoolReranker(index, 1.0).rerank([query], [["date elderberry fig"]], pool)
    assert rows[0, : hits.size].tolist() == hits.tolist()  # then the documents scoring 0
    assert rows[0, hits.size :].tolist() == sorted(set(range(5)) - set(hits.tolist()))
    # λ = 1: the query's own BM25 scaled by 1 / |Q| (4 tokens, apple counted twice)
    np.testing.assert_allclose(scores[0, : hits.size], own_scores[0, : hits.size] / 4, atol=1e-6)


def test_version_hashes_lambda_and_the_index(index: BM25Index, tmp_path: Path) -> None:
    assert PoolReranker(index).query_weight == DEFAULT_QUERY_WEIGHT
    assert PoolReranker(index, 0.5).version == PoolReranker(index, 0.5).version
    assert PoolReranker(index, 0.5).version != PoolReranker(index, 0.6).version
    other, _ = build_or_load_bm25(DOCS[:4], tmp_path)
    assert PoolReranker(other, 0.5).version != PoolReranker(index, 0.5).version


def test_bad_input_is_refused_with_a_clear_value_error(index: BM25Index) -> None:
    for weight in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
            PoolReranker(index, weight)
    reranker = PoolReranker(index)
    with pytest.raises(ValueError, match="empty"):
        reranker.rerank(["apple"], [[]], np.zeros((1, 0), dtype=np.int64))
    for bad in (5, -2):
        with pytest.raises(ValueError, match="unknown rows"):
            reranker.rerank(["apple"], [[]], np.array([[0, bad]]))
    with pytest.raises(ValueError, match="one query and one list of rewrites per"):
        reranker.rerank(["apple", "fig"], [[]], np.array([[0], [1]]))
    with pytest.raises(ValueError, match="one sequence of rewrite texts per query"):
        reranker.rerank(["apple"], ["cherry"], np.array([[0]]))
    with pytest.raises(ValueError, match="integers"):
        reranker.rerank(["apple"], [[]], np.array([[0.0]]))
