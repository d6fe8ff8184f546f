"""BM25 stemming (``CASI_BM25_STEMMER``): PyStemmer's Snowball English applied to documents and
queries alike after stopword removal; a stemmed index has its own version (an unstemmed index
keeps the version it had before stemming existed: the credit experiment pins one); a missing
PyStemmer is one line naming what to install. Real bm25s, real PyStemmer, nothing mocked (the
missing package is a real failed import). The SciFact numbers are in test_trec_parity.py."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from app.errors import SettingsError
from app.runtime import bm25_params
from app.settings import Settings, settings_error
from evaluator.bm25 import (
    BM25Params,
    _bm25s,
    bm25_version,
    build_or_load_bm25,
    encoder_version,
    tokenize,
)
from evaluator.corpus import Document, load_dataset
from evaluator.index import INDEX_DIRNAME
from evaluator.retrievers import RetrieverSpec, build_retriever

SCIFACT = Path(__file__).resolve().parents[2] / "data" / "scifact"
PINNED_SCIFACT_VERSION = "e5dbf8c6c0fd"  # the credit experiment's unstemmed full-corpus index
PINNED_WITH_BM25S = "0.3.16"

STEMMED = BM25Params(stemmer="english")
DOCS = [
    Document("a", "Bird", "a bird in the hand"),
    Document("b", "Cats", "cats chase mice running"),
    Document("c", "Dog", "the dog barks"),
]


def test_english_stems_tokens_after_removing_stopwords() -> None:
    text = ["The Cats, running studies and STUDYING"]
    assert tokenize(text, BM25Params()) == [["cats", "running", "studies", "studying"]]
    assert tokenize(text, STEMMED) == [["cat", "run", "studi", "studi"]]
    assert tokenize(["the and of"], STEMMED) == [[]]


def test_a_stemmed_index_matches_inflections_and_has_its_own_version(tmp_path: Path) -> None:
    plain, built_plain = build_or_load_bm25(DOCS, tmp_path)
    stemmed, built_stemmed = build_or_load_bm25(DOCS, tmp_path, STEMMED)
    assert built_plain and built_stemmed and plain.version != stemmed.version
    assert plain.encoder_version != stemmed.encoder_version
    queries = ["birds", "cat", "run"]
    rows, _ = plain.retrieve(queries, 2)
    assert (rows == -1).all()  # "birds" ≠ "bird", "cat" ≠ "cats", "run" ≠ "running"
    rows, scores = stemmed.retrieve(queries, 2)
    assert rows[:, 0].tolist() == [0, 1, 1] and (rows[:, 1] == -1).all()
    assert np.isfinite(scores[:, 0]).all()

    # both live side by side under var/index/<version>/; the stemmed one records its stemmer
    meta = json.loads((tmp_path / INDEX_DIRNAME / stemmed.version / "meta.json").read_text())
    assert meta["params"]["stemmer"] == "english"
    assert meta["stemmer_version"].startswith("PyStemmer ")
    old = json.loads((tmp_path / INDEX_DIRNAME / plain.version / "meta.json").read_text())
    assert old["params"]["stemmer"] is None and "stemmer_version" not in old
    again, built = build_or_load_bm25(DOCS, tmp_path, STEMMED)  # reloaded, not rebuilt
    assert not built and again.version == stemmed.version
    np.testing.assert_array_equal(again.retrieve(queries, 2)[0], rows)

    # the registry builds the same index from the settings' parameters
    via_settings, built = build_retriever(
        "bm25", RetrieverSpec(DOCS, tmp_path, params=Settings(bm25_stemmer="english").bm25_params())
    )
    assert not built and via_settings.version == stemmed.version


def test_the_unstemmed_version_is_unchanged() -> None:
    """The unstemmed encoder under rules 1 hashes exactly what it hashed before the stemmer
    (and the rules) existed, and the settings' ``none`` and 1 are that index."""
    params = BM25Params(rules=1)
    before = f"bm25|{params.canonical()}|bm25s {_bm25s().__version__}"
    assert encoder_version(params) == hashlib.sha256(before.encode()).hexdigest()[:12]
    assert '"stemmer": null' in params.canonical() and "rules" not in params.canonical()
    assert BM25Params(**Settings(bm25_stemmer="none", bm25_rules=1).bm25_params()) == params
    assert encoder_version(BM25Params()) != encoder_version(params)  # rules 2: other lists
    if _bm25s().__version__ == PINNED_WITH_BM25S:
        documents = load_dataset(SCIFACT).documents
        assert len(documents) == 5183
        assert bm25_version(documents, params) == PINNED_SCIFACT_VERSION
        assert bm25_version(documents, STEMMED) != PINNED_SCIFACT_VERSION


def test_missing_pystemmer_is_one_line_naming_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "Stemmer", None)  # `import Stemmer` now fails for real
    with pytest.raises(ValueError) as info:
        BM25Params(stemmer="english")
    assert "\n" not in str(info.value) and "pip install PyStemmer" in str(info.value)
    assert BM25Params().stemmer is None  # no stemming needs no PyStemmer
    with pytest.raises(SettingsError) as err:
        bm25_params(Settings(bm25_stemmer="english"))
    line = err.value.line()
    assert "\n" not in line
    assert line.startswith("CASI_BM25_STEMMER=english needs the PyStemmer package")
    assert line.endswith("pip install PyStemmer, or set CASI_BM25_STEMMER=none")
    assert bm25_params(Settings(bm25_stemmer="none"))["stemmer"] is None


def test_the_setting_takes_none_or_english(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CASI_BM25_STEMMER", raising=False)
    assert Settings().bm25_stemmer == "english"  # the default: better on SciFact (the doc page)
    monkeypatch.setenv("CASI_BM25_STEMMER", "none")
    assert Settings().bm25_params()["stemmer"] is None
    monkeypatch.setenv("CASI_BM25_STEMMER", "porter")
    with pytest.raises(ValidationError) as info:
        Settings()
    line = settings_error(info.value).line()
    assert line.startswith("invalid CASI_BM25_STEMMER='porter'") and "none, english" in line
    monkeypatch.setenv("CASI_BM25_STEMMER", "english")
    assert Settings().bm25_params()["stemmer"] == "english"
    with pytest.raises(ValueError, match="unknown BM25 stemmer 'porter'; valid: none, english"):
        BM25Params(stemmer="porter")
