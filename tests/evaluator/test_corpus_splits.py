"""Any BEIR folder loads, including one that ships only test qrels; a needed split that is
missing names its file; graded relevance is graded gain (closed-form nDCG)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from evaluator.corpus import DatasetError, available_splits, load_dataset
from evaluator.retrieval_eval import evaluate_retriever, ndcg_recall_at_k
from evaluator.scorers import make_scorer


def _folder(root: Path, splits: dict[str, str]) -> Path:
    (root / "qrels").mkdir(parents=True)
    with (root / "corpus.jsonl").open("w") as fh:
        for i in range(6):
            fh.write(json.dumps({"_id": f"d{i}", "title": "", "text": f"text {i} word{i}"}) + "\n")
    (root / "queries.jsonl").write_text(
        "\n".join(json.dumps({"_id": f"q{i}", "text": f"word{i}"}) for i in range(3)) + "\n"
    )
    for split, body in splits.items():
        (root / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + body)
    return root


def test_test_only_folder_loads_and_asks_for_train_by_name(tmp_path: Path) -> None:
    root = _folder(tmp_path, {"test": "q0\td0\t2\nq0\td1\t1\nq1\td1\t1\n"})
    assert available_splits(root) == ["test"]
    ds = load_dataset(root)  # no qrels/train.tsv: fine until a split is needed
    assert list(ds.qrels) == ["test"] and ds.split_query_ids("test") == ["q0", "q1"]
    assert ds.qrels["test"]["q0"] == {"d0": 2, "d1": 1}  # grades kept
    with pytest.raises(DatasetError, match=r"qrels/train\.tsv: the train split is needed"):
        ds.split_query_ids("train")
    with pytest.raises(DatasetError, match=r"file not found\); splits available: test"):
        ds.qrels_rows("train")
    with pytest.raises(DatasetError, match=r"train\.tsv: file not found"):
        load_dataset(root, splits=("train",))  # asked for explicitly: required
    sliced = load_dataset(root, max_docs=1)  # the slice keeps every judged document
    assert sliced.doc_ids == ["d0", "d1"]


def test_folder_without_any_qrels_can_be_indexed(tmp_path: Path) -> None:
    ds = load_dataset(_folder(tmp_path, {}))
    assert ds.qrels == {} and len(ds.documents) == 6
    with pytest.raises(DatasetError, match="splits available: none"):
        ds.check_split("test")


def _closed_form() -> float:
    """Ranked [d1 (grade 1), d9 (0), d0 (grade 2)] vs ideal [d0, d1]: gains 2^g − 1."""
    dcg = 1 / math.log2(2) + 0 + 3 / math.log2(4)
    idcg = 3 / math.log2(2) + 1 / math.log2(3)
    return dcg / idcg


def test_graded_ndcg_closed_form_plain_and_replay() -> None:
    rels = {0: 2, 1: 1}
    ndcg, recall = ndcg_recall_at_k([1, 9, 0], rels, 3)
    assert ndcg == pytest.approx(_closed_form(), abs=1e-12) and recall == 1.0
    replay = make_scorer("replay", qrels={"q": rels}, k=3)
    got = replay.score(["q"], torch.zeros(1, 0), torch.tensor([[[1, 9, 0]]]))
    assert float(got[0, 0]) == pytest.approx(_closed_form(), abs=1e-6)
    binary = make_scorer("replay", qrels={"q": {0: 1, 1: 1}}, k=3)  # grades matter
    assert float(binary.score(["q"], torch.zeros(1, 0), torch.tensor([[[1, 9, 0]]]))[0, 0]) != (
        pytest.approx(_closed_form(), abs=1e-3)
    )


def test_bm25_evaluates_a_test_only_folder(tmp_path: Path) -> None:
    from evaluator.retrievers import RetrieverSpec, build_retriever

    root = _folder(tmp_path / "data", {"test": "q0\td0\t2\nq1\td1\t1\n"})
    ds = load_dataset(root)
    retriever, built = build_retriever("bm25", RetrieverSpec(ds.documents, tmp_path / "var"))
    res = evaluate_retriever(ds, retriever, "test", 10, recall_k=100)
    assert built and res["n_queries"] == 2 and res["ndcg"] == 1.0 and res["recall@100"] == 1.0
    assert res["retriever"] == "bm25"


def test_split_without_positive_judgments_is_refused_naming_its_file(tmp_path: Path) -> None:
    from evaluator.retrievers import RetrieverSpec, build_retriever

    root = _folder(tmp_path / "data", {"test": "q0\td0\t0\nq1\td1\t0\n", "train": "q0\td0\t1\n"})
    ds = load_dataset(root)  # loads: only code that needs the split refuses it
    assert ds.qrels["test"] == {} and ds.split_query_ids("train") == ["q0"]
    want = r"qrels/test\.tsv: the test split has no positive judgments"
    for ask in (ds.check_split, ds.split_query_ids, ds.qrels_rows):
        with pytest.raises(DatasetError, match=want):
            ask("test")
    retriever, _ = build_retriever("bm25", RetrieverSpec(ds.documents, tmp_path / "var"))
    with pytest.raises(DatasetError, match=want):  # was an IndexError from numpy
        evaluate_retriever(ds, retriever, "test", 10)
    header_only = _folder(tmp_path / "empty", {"test": ""})
    with pytest.raises(DatasetError, match=want):
        load_dataset(header_only, splits=("test",)).split_query_ids("test")
