"""`casi experiment credit --protocol` pins the BM25 stemmer to the protocol's: an environment's
``bm25_stemmer`` when its table names one, else ``none`` — so the committed credit-units
protocol (which names none) keeps its unstemmed index whatever CASI_BM25_STEMMER or the default
says; likewise its BM25 rules (1 when it names none, whatever CASI_BM25_RULES says). The settings the runner builds are checked; no cell runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.experiments.cell import cell_settings
from app.experiments.protocol import load_protocol
from app.settings import Settings
from evaluator.bm25 import BM25Params, _bm25s, bm25_version
from evaluator.corpus import load_dataset

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "docs" / "experiments" / "credit-units" / "protocol.toml"


def _with_stemmer(tmp_path: Path, value: str) -> Path:
    """A copy of the committed protocol whose main environment names a stemmer."""
    text = PROTOCOL.read_text(encoding="utf-8")
    text, n = re.subn(
        r"^\[environments\.main\].*$", lambda m: f'{m.group(0)}\nbm25_stemmer = "{value}"', text,
        flags=re.M,
    )  # fmt: skip
    assert n == 1
    path = tmp_path / "protocol.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_committed_protocol_runs_unstemmed_whatever_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    protocol = load_protocol(PROTOCOL)
    assert "bm25_stemmer" not in protocol.raw["environments"]["main"]
    monkeypatch.setenv("CASI_BM25_STEMMER", "english")  # the machine asks for stemming
    monkeypatch.setenv("CASI_BM25_RULES", "2")  # and for the exact top k over NFKC text
    settings = Settings()
    assert settings.bm25_stemmer == "english" and settings.bm25_rules == 2
    for name in ("main", "control"):
        env = protocol.environment(name)
        pinned = cell_settings(settings, protocol, env)
        assert pinned.bm25_stemmer == "none" and pinned.bm25_params()["stemmer"] is None
        assert (pinned.retriever, pinned.merge, pinned.rrf_k) == (
            env.retriever,
            env.merge,
            env.rrf_k,
        )
    assert settings.bm25_stemmer == "english"  # the runner's copy, not the caller's settings
    main = cell_settings(settings, protocol, protocol.environment("main"))
    params = BM25Params(**main.bm25_params())
    assert params == BM25Params(rules=1)  # the rules the cells were made with
    if _bm25s().__version__ == "0.3.16":  # the version the cells pinned was built with
        documents = load_dataset(ROOT / "data" / "scifact", max_docs=protocol.max_docs).documents
        assert bm25_version(documents, params) == "e5dbf8c6c0fd"


def test_a_protocol_that_names_a_stemmer_gets_it(tmp_path: Path) -> None:
    committed = load_protocol(PROTOCOL)
    protocol = load_protocol(_with_stemmer(tmp_path, "english"))
    assert protocol.hash != committed.hash  # a new protocol: its cells go to a new folder
    settings = Settings(bm25_stemmer="none")
    main = cell_settings(settings, protocol, protocol.environment("main"))
    assert main.bm25_stemmer == "english" and main.bm25_params()["stemmer"] == "english"
    control = cell_settings(settings, protocol, protocol.environment("control"))
    assert control.bm25_stemmer == "none"  # named per environment


def test_an_unknown_stemmer_in_a_protocol_is_one_line(tmp_path: Path) -> None:
    path = _with_stemmer(tmp_path, "porter")
    with pytest.raises(ValueError) as info:  # when the protocol is read, not when a cell starts
        load_protocol(path)
    assert str(info.value) == (
        f"protocol {path}: [environments.main] bm25_stemmer = 'porter': must be one of none, english"
    )
