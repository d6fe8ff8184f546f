"""The BEIR loader: real bundled data loads; each kind of bad input names file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evaluator.corpus import DatasetError, load_dataset

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp: Path, corpus: str, queries: str, train: str) -> Path:
    (tmp / "qrels").mkdir(parents=True, exist_ok=True)
    (tmp / "corpus.jsonl").write_text(corpus)
    (tmp / "queries.jsonl").write_text(queries)
    (tmp / "qrels" / "train.tsv").write_text(train)
    return tmp


GOOD_CORPUS = (
    json.dumps({"_id": "d1", "title": "T1", "text": "alpha"})
    + "\n"
    + json.dumps({"_id": "d2", "title": "T2", "text": "beta"})
    + "\n"
)
GOOD_QUERIES = json.dumps({"_id": "q1", "text": "what is alpha"}) + "\n"
GOOD_QRELS = "query-id\tcorpus-id\tscore\nq1\td1\t1\n"


def test_bundled_scifact_slice_loads() -> None:
    ds = load_dataset(ROOT / "data" / "scifact", max_docs=100)
    assert len(ds.queries) == 1109
    assert len(ds.qrels["train"]) == 809 and len(ds.qrels["test"]) == 300
    judged = {d for s in ds.qrels.values() for r in s.values() for d in r}
    # slice = first 100 documents + every judged document
    assert set(ds.doc_ids) >= judged
    assert len(ds.doc_ids) == len(set(ds.doc_ids[:100]) | judged)
    assert ds.documents[0].doc_id == "4983"
    assert ds.row_of[ds.doc_ids[5]] == 5


def test_small_dataset_round_trip(tmp_path: Path) -> None:
    ds = load_dataset(_write(tmp_path, GOOD_CORPUS, GOOD_QUERIES, GOOD_QRELS), splits=("train",))
    assert ds.doc_ids == ["d1", "d2"]
    assert ds.qrels["train"] == {"q1": {"d1": 1}}
    assert ds.qrels_rows("train") == {"q1": {0: 1}}
    assert ds.documents[1].retrieval_text == "T2 beta"


def test_missing_file_is_named(tmp_path: Path) -> None:
    root = _write(tmp_path, GOOD_CORPUS, GOOD_QUERIES, GOOD_QRELS)
    (root / "queries.jsonl").unlink()
    with pytest.raises(DatasetError, match=r"queries\.jsonl: file not found"):
        load_dataset(root, splits=("train",))
    with pytest.raises(DatasetError, match=r"test\.tsv: file not found"):
        load_dataset(
            _write(tmp_path, GOOD_CORPUS, GOOD_QUERIES, GOOD_QRELS), splits=("train", "test")
        )


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="dataset folder not found"):
        load_dataset(tmp_path / "nope")


def test_malformed_json_line_names_line(tmp_path: Path) -> None:
    bad = GOOD_CORPUS + '{"_id": "d3", "title": \n'
    with pytest.raises(DatasetError, match=r"corpus\.jsonl:3: malformed JSON"):
        load_dataset(_write(tmp_path, bad, GOOD_QUERIES, GOOD_QRELS), splits=("train",))


def test_object_without_id(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"queries\.jsonl:1: expected an object with an '_id'"):
        load_dataset(
            _write(tmp_path, GOOD_CORPUS, '{"text": "x"}\n', GOOD_QRELS), splits=("train",)
        )


def test_qrels_unknown_document(tmp_path: Path) -> None:
    qrels = GOOD_QRELS + "q1\td9\t1\n"
    with pytest.raises(DatasetError, match=r"train\.tsv:3: unknown document id 'd9'"):
        load_dataset(_write(tmp_path, GOOD_CORPUS, GOOD_QUERIES, qrels), splits=("train",))


def test_qrels_unknown_query(tmp_path: Path) -> None:
    qrels = GOOD_QRELS + "q7\td1\t1\n"
    with pytest.raises(DatasetError, match=r"train\.tsv:3: unknown query id 'q7'"):
        load_dataset(_write(tmp_path, GOOD_CORPUS, GOOD_QUERIES, qrels), splits=("train",))


def test_qrels_bad_row(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"train\.tsv:2: expected 3 tab-separated fields"):
        load_dataset(
            _write(tmp_path, GOOD_CORPUS, GOOD_QUERIES, "query-id\tcorpus-id\tscore\nq1 d1 1\n"),
            splits=("train",),
        )
    with pytest.raises(DatasetError, match=r"train\.tsv:2: score 'high' is not an integer"):
        load_dataset(
            _write(
                tmp_path, GOOD_CORPUS, GOOD_QUERIES, "query-id\tcorpus-id\tscore\nq1\td1\thigh\n"
            ),
            splits=("train",),
        )


def test_empty_corpus(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"corpus\.jsonl: corpus is empty"):
        load_dataset(_write(tmp_path, "\n", GOOD_QUERIES, GOOD_QRELS), splits=("train",))


def test_duplicate_document(tmp_path: Path) -> None:
    dup = GOOD_CORPUS + json.dumps({"_id": "d1", "title": "", "text": "again"}) + "\n"
    with pytest.raises(DatasetError, match=r"corpus\.jsonl:3: duplicate document id 'd1'"):
        load_dataset(_write(tmp_path, dup, GOOD_QUERIES, GOOD_QRELS), splits=("train",))


def test_repeated_judgment_names_both_lines(tmp_path: Path) -> None:
    for second in ("1", "0", "2"):  # same grade, a zero, another grade: all refused
        qrels = GOOD_QRELS + "q1\td2\t1\n" + f"q1\td1\t{second}\n"
        with pytest.raises(
            DatasetError,
            match=r"train\.tsv:4: query 'q1' and document 'd1' are judged again \(first at line 2\)",
        ):
            load_dataset(_write(tmp_path, GOOD_CORPUS, GOOD_QUERIES, qrels), splits=("train",))
    # the same document under another query, or in another split, is not a repeat
    ok = GOOD_QRELS + "q2\td1\t1\n"
    queries = GOOD_QUERIES + json.dumps({"_id": "q2", "text": "beta"}) + "\n"
    ds = load_dataset(_write(tmp_path, GOOD_CORPUS, queries, ok), splits=("train",))
    assert ds.qrels["train"] == {"q1": {"d1": 1}, "q2": {"d1": 1}}


@pytest.mark.parametrize("name", ["scifact", "nfcorpus"])
def test_bundled_qrels_have_no_repeated_pairs(name: str) -> None:
    ds = load_dataset(ROOT / "data" / name)  # every split, every line checked
    for split in ds.qrels:
        ds.check_split(split)
