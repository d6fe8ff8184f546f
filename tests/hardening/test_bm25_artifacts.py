"""The BM25 index under var/ follows the FAISS index's rules: versioned folder, manifest,
built once and reused, every kind of damage detected and rebuilt (never used), a parameter or
corpus change builds a new version. Real files, real bm25s; nothing mocked."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hardening_support import flip_byte, truncate

from evaluator.artifacts import MANIFEST_NAME, verify_folder
from evaluator.bm25 import MODEL_DIR, BM25Params, build_or_load_bm25, load_bm25
from evaluator.corpus import load_dataset
from evaluator.index import INDEX_DIRNAME

QUERIES = ["what is known about topic 3", "document 7", "title 12 topic 2"]


@pytest.fixture(scope="module")
def bm25_var(tiny_beir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(dataset, var dir with a sound BM25 index, its folder, its answers to QUERIES)."""
    ds = load_dataset(tiny_beir)
    var = tmp_path_factory.mktemp("var-bm25")
    index, built = build_or_load_bm25(ds.documents, var)
    assert built
    return ds, var, var / INDEX_DIRNAME / index.version, index.retrieve(QUERIES, 5)


def test_built_once_then_reused_with_a_manifest(bm25_var) -> None:  # type: ignore[no-untyped-def]
    ds, var, folder, (rows, scores) = bm25_var
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["retriever"] == "bm25" and meta["n_docs"] == len(ds.documents)
    assert meta["params"]["k1"] == 1.5 and meta["params"]["stemmer"] is None
    verify_folder(folder, deep=True)
    again, built = build_or_load_bm25(ds.documents, var)
    assert not built and again.version == folder.name
    got_rows, got_scores = again.retrieve(QUERIES, 5)
    np.testing.assert_array_equal(got_rows, rows)
    np.testing.assert_array_equal(got_scores, scores)


def test_parameters_and_corpus_make_new_versions(bm25_var, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ds, var, folder, _ = bm25_var
    work = tmp_path / "var"
    shutil.copytree(var, work)
    other, built = build_or_load_bm25(ds.documents, work, BM25Params(k1=0.9, b=0.4))
    assert built and other.version != folder.name
    sliced, built = build_or_load_bm25(ds.documents[:-1], work)
    assert built and sliced.version not in (folder.name, other.version)
    assert load_bm25(work, folder.name, BM25Params(), ds.doc_ids) is not None  # the old one stays


def _garble_meta(folder: Path) -> None:
    (folder / "meta.json").write_text('{"version": ')


def _shorten_ids(folder: Path) -> None:
    ids = json.loads((folder / "doc_ids.json").read_text())
    (folder / "doc_ids.json").write_text(json.dumps(ids[:-1]))


def _model(folder: Path, name: str) -> Path:
    return folder / MODEL_DIR / name


DAMAGE: dict[str, Callable[[Path], None]] = {
    "data-flipped-byte": lambda f: flip_byte(_model(f, "data.csc.index.npy"), offset=-3),
    "data-flipped-byte-same-mtime": lambda f: flip_byte(
        _model(f, "data.csc.index.npy"), offset=-3, keep_mtime=True
    ),
    "indices-truncated": lambda f: truncate(_model(f, "indices.csc.index.npy")),
    "indptr-missing": lambda f: _model(f, "indptr.csc.index.npy").unlink(),
    "vocab-garbled": lambda f: _model(f, "vocab.index.json").write_text("{"),
    "params-zeroed": lambda f: _model(f, "params.index.json").write_bytes(
        bytes(_model(f, "params.index.json").stat().st_size)
    ),
    "ids-shortened": _shorten_ids,
    "meta-garbled": _garble_meta,
    "meta-missing": lambda f: (f / "meta.json").unlink(),
    "manifest-missing": lambda f: (f / MANIFEST_NAME).unlink(),  # no older BM25 format to adopt
    "folder-is-a-file": lambda f: (shutil.rmtree(f), f.write_text("junk")),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_bm25_index_is_rebuilt_never_used(  # type: ignore[no-untyped-def]
    damage: str, bm25_var, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds, var, folder, (rows, scores) = bm25_var
    work = tmp_path / "var"
    shutil.copytree(var / INDEX_DIRNAME, work / INDEX_DIRNAME)
    target = work / INDEX_DIRNAME / folder.name
    load_bm25(work, folder.name, BM25Params(), ds.doc_ids)  # first load: hashes stamped
    DAMAGE[damage](target)
    with caplog.at_level(logging.WARNING):
        index, built = build_or_load_bm25(ds.documents, work)
    assert built and f"BM25 index {target} is damaged" in caplog.text
    got_rows, got_scores = index.retrieve(QUERIES, 5)
    np.testing.assert_array_equal(got_rows, rows)
    np.testing.assert_array_equal(got_scores, scores)
    verify_folder(target, deep=True)  # what is on disk now is whole
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".tmp-")] == []
    _, built_again = build_or_load_bm25(ds.documents, work)
    assert not built_again  # rebuilt once, then reused


@pytest.mark.integration
def test_cli_on_a_folder_with_only_test_qrels(casi, tiny_beir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`casi index build` needs only the corpus; `index eval` only the split it evaluates."""
    data = tmp_path / "test-only"
    shutil.copytree(tiny_beir, data)
    (data / "qrels" / "train.tsv").unlink()
    var = tmp_path / "var"
    built = casi(["index", "build", "--retriever", "bm25"], var, CASI_DATASET=str(data))
    assert built.returncode == 0 and "bm25 index" in built.output and " built: " in built.output
    ev = casi(
        ["index", "eval", "--split", "test"], var, CASI_DATASET=str(data), CASI_RETRIEVER="bm25"
    )
    assert ev.returncode == 0 and "nDCG@10" in ev.output and "recall@100" in ev.output, ev.output
    casi(["index", "eval", "--split", "train"], var, CASI_DATASET=str(data)).assert_one_error(
        "train.tsv"
    )
