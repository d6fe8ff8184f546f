"""CASI's nDCG@10 and recall@100 against trec_eval's (``pytrec_eval``: trec_eval's own C code).

Both of CASI's implementations are checked: :func:`evaluator.retrieval_eval.ndcg_recall_at_k`
(``casi index eval``) and the replay scorer (the credit game and the held-out evaluation).

- SciFact, BM25 of the claim alone on the 300 TEST claims (unstemmed and stemmed, the project's
  own index): per claim and on the mean, equal to 1e-6.
- A graded fixture (grades 0-3, tied scores, a query with nothing relevant retrieved, one with
  more relevant documents than k, one with only grade-0 judgments, one with an empty run).
  Recall is the same definition. nDCG differs in one place, the gain: CASI's is 2^g − 1,
  trec_eval's ``ndcg_cut`` is g itself; CASI's value is trec_eval's on qrels whose grades are
  mapped g → 2^g − 1 (equal on binary qrels, e.g. SciFact). Two more differences are in what
  is scored, not in the metric: trec_eval re-sorts a run by score and breaks ties by document id
  *descending*, CASI scores a ranked list as given (its retrievers and fusion rank ties by the
  smaller row first); and trec_eval (without ``-c``) averages over the queries the run has,
  CASI over every query of the split (a query with nothing retrieved counts 0).

Nothing is mocked; numbers the doc page (docs/experiments/bm25-stemming.md) reports are pinned
for the bm25s version they were measured with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import pytrec_eval  # dev dependency (pytrec-eval-terrier)
import torch

from evaluator.bm25 import BM25Index, BM25Params, _bm25s, build_or_load_bm25
from evaluator.corpus import Dataset, load_dataset
from evaluator.retrieval_eval import evaluate_retriever, ndcg_recall_at_k
from evaluator.scorers import make_scorer

SCIFACT = Path(__file__).resolve().parents[2] / "data" / "scifact"
MEASURES = {"ndcg_cut.10", "recall.100"}
TOL = 1e-6

Run = dict[str, dict[str, float]]
Qrels = dict[str, dict[str, int]]

# nDCG@10 / recall@100 on the 300 TEST claims, measured with bm25s 0.3.16 (the doc page's table)
MEASURED = {None: (0.661691, 0.875889), "english": (0.686300, 0.912667)}
MEASURED_WITH = "0.3.16"


def trec(qrels: Qrels, run: Run) -> dict[str, dict[str, float]]:
    return dict(pytrec_eval.RelevanceEvaluator(qrels, MEASURES).evaluate(run))


def rank_run(ranked: Mapping[str, list[str]]) -> Run:
    """A run whose scores (1 / rank) are strictly descending: trec_eval reads this order."""
    return {q: {d: 1.0 / r for r, d in enumerate(docs, start=1)} for q, docs in ranked.items()}


def trec_order(scored: Mapping[str, float]) -> list[str]:
    """trec_eval's ranking of a scored run: score descending, ties by document id descending."""
    return [d for d, _ in sorted(scored.items(), key=lambda x: (x[1], x[0]), reverse=True)]


def casi_scores(
    qrels: Qrels, ranked: Mapping[str, list[str]], docs: list[str]
) -> dict[str, tuple[float, float]]:
    """(nDCG@10, recall@100) per query from both CASI implementations; they must agree."""
    row = {d: i for i, d in enumerate(docs)}
    rels = {q: {row[d]: g for d, g in judged.items()} for q, judged in qrels.items()}
    qids = list(ranked)
    lists = torch.full((len(qids), 1, 100), -1, dtype=torch.long)
    out = {}
    for i, q in enumerate(qids):
        rows = [row[d] for d in ranked[q]][:100]
        lists[i, 0, : len(rows)] = torch.tensor(rows, dtype=torch.long)
        ndcg, _ = ndcg_recall_at_k(rows, rels[q], 10)
        _, recall = ndcg_recall_at_k(rows, rels[q], 100)
        out[q] = (ndcg, recall)
    no_emb = torch.zeros(len(qids), 0)
    ndcg_scorer = make_scorer("replay", qrels=rels, k=10, allow_unjudged=True)  # grade 0 only: 0
    recall_scorer = make_scorer("replay", qrels=rels, k=100, metric="recall", allow_unjudged=True)
    by_replay_ndcg = ndcg_scorer.score(qids, no_emb, lists[:, :, :10])
    by_replay_recall = recall_scorer.score(qids, no_emb, lists)
    for i, q in enumerate(qids):
        assert abs(float(by_replay_ndcg[i, 0]) - out[q][0]) <= 1e-12, q
        assert abs(float(by_replay_recall[i, 0]) - out[q][1]) <= 1e-12, q
    return out


# --- (a) SciFact: BM25 of the claim alone, TEST claims ----------------------------------------


@pytest.fixture(scope="module")
def scifact() -> Dataset:
    return load_dataset(SCIFACT)


@pytest.fixture(scope="module")
def scifact_var(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("var-scifact-bm25")


@pytest.mark.parametrize("stemmer", [None, "english"])
def test_scifact_bm25_test_claims_equal_trec_eval(
    scifact: Dataset, scifact_var: Path, stemmer: str | None
) -> None:
    index: BM25Index
    index, _ = build_or_load_bm25(scifact.documents, scifact_var, BM25Params(stemmer=stemmer))
    qids = scifact.split_query_ids("test")
    assert len(qids) == 300
    rows, scores = index.retrieve([scifact.queries[q] for q in qids], 100)
    ranked = {q: [index.doc_ids[r] for r in rows[i] if r >= 0] for i, q in enumerate(qids)}
    qrels: Qrels = {q: dict(scifact.qrels["test"][q]) for q in qids}

    by_trec = trec(qrels, rank_run(ranked))
    by_casi = casi_scores(qrels, ranked, index.doc_ids)
    assert sorted(by_trec) == sorted(qids)
    for q in qids:
        assert abs(by_casi[q][0] - by_trec[q]["ndcg_cut_10"]) <= TOL, q
        assert abs(by_casi[q][1] - by_trec[q]["recall_100"]) <= TOL, q

    # the mean `casi index eval` reports, and trec_eval's, on the same 300 claims
    res = evaluate_retriever(scifact, index, "test", 10, 100)
    trec_ndcg = float(np.mean([by_trec[q]["ndcg_cut_10"] for q in qids]))
    trec_recall = float(np.mean([by_trec[q]["recall_100"] for q in qids]))
    assert abs(res["ndcg"] - trec_ndcg) <= TOL and abs(res["recall@100"] - trec_recall) <= TOL

    # BM25's own scores as the run: trec_eval re-sorts ties by document id, which on these
    # claims never moves a relevant document across the cut (same numbers)
    raw = {q: {index.doc_ids[r]: float(s) for r, s in zip(rows[i], scores[i], strict=True) if r >= 0}
           for i, q in enumerate(qids)}  # fmt: skip
    by_raw = trec(qrels, raw)
    assert abs(np.mean([by_raw[q]["ndcg_cut_10"] for q in qids]) - trec_ndcg) <= TOL

    if _bm25s().__version__ == MEASURED_WITH:  # the doc page's numbers
        assert (round(res["ndcg"], 6), round(res["recall@100"], 6)) == MEASURED[stemmer]


# --- (b) a graded fixture -----------------------------------------------------------------------

DOCS = [f"d{i:03d}" for i in range(1, 301)]


def graded_fixture() -> tuple[Qrels, Run]:
    qrels: Qrels = {
        # graded, with a judged non-relevant document and one judged relevant never retrieved
        "q1": {"d001": 3, "d002": 2, "d003": 1, "d004": 0, "d005": 2, "d020": 1},
        # nothing relevant retrieved
        "q2": {"d010": 1, "d011": 2},
        # 120 relevant documents (> 10 and > 100), grades 1..3
        "q3": {DOCS[i]: 1 + i % 3 for i in range(120)},
        # only grade-0 judgments: no relevant document at all
        "q4": {"d001": 0, "d002": 0},
        # binary, with tied scores across a relevant and a non-relevant document
        "q5": {"d007": 1, "d008": 1},
    }
    run: Run = {
        "q1": {"d003": 5.0, "d001": 5.0, "d002": 4.0, "d006": 4.0, "d004": 3.0, "d005": 1.0},
        "q2": {"d001": 3.0, "d002": 2.0, "d003": 1.0},
        # 150 documents: every other one of the relevant 120 first, then non-relevant ones
        "q3": {d: 300.0 - i for i, d in enumerate([*DOCS[0:120:2], *DOCS[150:240]])},
        "q4": {"d001": 2.0, "d009": 1.0},
        "q5": {"d009": 2.0, "d007": 2.0, "d001": 1.0, "d008": 1.0},
    }
    return qrels, run


def exp_gain(qrels: Qrels) -> Qrels:
    return {q: {d: 2**g - 1 for d, g in judged.items()} for q, judged in qrels.items()}


def test_graded_fixture_equals_trec_eval_up_to_the_gain() -> None:
    qrels, run = graded_fixture()
    ranked = {q: trec_order(scored) for q, scored in run.items()}  # what trec_eval scores
    casi = casi_scores(qrels, ranked, DOCS)
    linear = trec(qrels, run)  # trec_eval as is: gain g
    exponential = trec(exp_gain(qrels), run)  # trec_eval with gains 2^g − 1 in the qrels
    for q in qrels:
        assert abs(casi[q][0] - exponential[q]["ndcg_cut_10"]) <= TOL, q
        assert abs(casi[q][1] - linear[q]["recall_100"]) <= TOL, q  # recall: one definition
        assert abs(casi[q][1] - exponential[q]["recall_100"]) <= TOL, q
    # the gain is the one difference, and only on graded judgments
    for q in ("q2", "q4", "q5"):  # binary (or nothing relevant): the same nDCG
        assert abs(casi[q][0] - linear[q]["ndcg_cut_10"]) <= TOL, q
    for q in ("q1", "q3"):
        assert abs(casi[q][0] - linear[q]["ndcg_cut_10"]) > 1e-3, q
    assert round(casi["q1"][0], 4) == 0.6938 and round(linear["q1"]["ndcg_cut_10"], 4) == 0.7347
    # edge cases, the same on both sides
    assert casi["q2"] == (0.0, 0.0) and linear["q2"]["ndcg_cut_10"] == 0.0  # none retrieved
    assert casi["q4"] == (0.0, 0.0) and linear["q4"]["ndcg_cut_10"] == 0.0  # none relevant
    assert casi["q3"][1] == pytest.approx(60 / 120)  # recall@100 over all 120, not min(R, 100)
    assert casi["q3"][0] < 1.0  # IDCG@10 from the 10 best grades of 120


def test_ties_and_missing_queries_are_what_is_scored_not_the_metric() -> None:
    qrels, run = graded_fixture()
    # ties: trec_eval breaks them by document id descending; CASI's lists rank the smaller
    # row (here: the smaller id) first. Same metric, different ranking → different value.
    ascending = {
        q: [d for d, _ in sorted(scored.items(), key=lambda x: (-x[1], x[0]))]
        for q, scored in run.items()
    }
    casi_ascending = casi_scores(qrels, ascending, DOCS)
    by_trec = trec(exp_gain(qrels), run)
    assert ascending["q5"][:2] == ["d007", "d009"] and trec_order(run["q5"])[:2] == ["d009", "d007"]
    assert casi_ascending["q5"][0] == pytest.approx(
        1 / (1 + 1 / math.log2(3)) * (1 + 1 / math.log2(5))
    )
    assert by_trec["q5"]["ndcg_cut_10"] < casi_ascending["q5"][0] - 0.1
    assert casi_ascending["q1"][0] != pytest.approx(by_trec["q1"]["ndcg_cut_10"])
    # the same tied run with strictly descending scores in CASI's order: trec_eval agrees again
    again = trec(exp_gain(qrels), rank_run(ascending))
    for q in qrels:
        assert abs(casi_ascending[q][0] - again[q]["ndcg_cut_10"]) <= TOL, q

    # a query the run does not have: trec_eval (no -c) leaves it out of the mean, CASI
    # counts it 0; an empty entry makes trec_eval count it 0 too
    qrels["q6"] = {"d001": 1}
    left_out = trec(qrels, run)
    assert "q6" not in left_out and len(left_out) == 5
    counted = trec(qrels, {**run, "q6": {}})
    assert counted["q6"] == {"ndcg_cut_10": 0.0, "recall_100": 0.0}
    assert casi_scores(qrels, {**ascending, "q6": []}, DOCS)["q6"] == (0.0, 0.0)
