"""Issue 51, item 12: the commands `casi train` prints at the end of a run (evaluate the final
policy, serve it) work when pasted: they carry the run's environment (the var folder whose
database knows the version, and the game: dataset, game, retriever, stemmer, depth; the slice)
and its rollout shape (and serving's degenerate guard when its held-out evaluations had it), on
one line each however narrow the console; and the before → after
table calls the dataset's queries by their name (claims only for SciFact)."""

from __future__ import annotations

import importlib
import os
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.progress import console
from app.settings import Settings
from policy.rollout import RolloutConfig

# the Makefile's `demo` target (DEMO_POOL_ENV)
DEMO_ENV = {
    "CASI_VAR_DIR": "var/demo-pool",
    "CASI_DATASET": "data/nfcorpus",
    "CASI_GAME": "pool",
    "CASI_RETRIEVER": "bm25",
    "CASI_BM25_STEMMER": "none",
    "CASI_RETRIEVAL_K": "50",
}
VERSION = "0123456789ab"
train_cli = importlib.import_module("app.cli.train")  # the module (app.cli.train is the command)


def _settings(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    """Settings read from exactly ``env`` (what a pasted command's assignments give it)."""
    for name in list(os.environ):
        if name.startswith("CASI_") or name in ("DATABASE_URL", "REDIS_URL"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings()


def _assignments(line: str, command: str) -> dict[str, str]:
    """The ``NAME=value`` words in front of ``casi <command>`` on a printed line."""
    words = shlex.split(line.split(":", 1)[1])
    at = words.index("casi")
    assert words[at + 1] == command, line
    return dict(w.split("=", 1) for w in words[:at])


def _printed_report(
    monkeypatch: pytest.MonkeyPatch, settings: Settings, rollout: RolloutConfig,
    max_docs: int | None = None, guarded: bool = False,
) -> list[str]:  # fmt: skip
    """What `_report` prints at the end of a run with a final checkpoint, on a 60-column console."""
    monkeypatch.setattr(train_cli, "report_run", lambda *a: (Path("curves.png"), Path("s.md")))
    cfg: Any = SimpleNamespace(
        params=SimpleNamespace(kind="full"), rollout=rollout,
        eval=SimpleNamespace(refuse_degenerate=guarded),
    )  # fmt: skip
    handle: Any = SimpleNamespace(
        run_id=7, evaluations={}, metrics_path=Path("m.jsonl"),
        last_checkpoint=(VERSION, Path("var/demo-pool/checkpoints/run-7")),
    )  # fmt: skip
    monkeypatch.setattr(console, "width", 60)
    with console.capture() as out:
        train_cli._report(None, settings, cfg, handle, max_docs)
    return out.get().splitlines()


def test_the_demo_hints_carry_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    run = _settings(monkeypatch, DEMO_ENV)
    rollout = RolloutConfig(prompt="short")
    lines = _printed_report(monkeypatch, run, rollout)
    evaluate = next(line for line in lines if line.startswith("  evaluate it:"))
    serve = next(line for line in lines if line.startswith("  serve it:"))
    assert _assignments(evaluate, "eval") == DEMO_ENV  # one line, though the console is narrow
    assert _assignments(serve, "serve") == {"CASI_API_POLICY": VERSION, **DEMO_ENV}
    assert shlex.split(evaluate)[-2:] == ["--prompt", "short"]  # the run's prompt style

    pasted = _settings(monkeypatch, _assignments(evaluate, "eval"))  # a shell with nothing set
    assert pasted.var_dir == run.var_dir
    assert train_cli.retrieval_settings(pasted) == train_cli.retrieval_settings(run)


def test_defaults_need_no_environment_and_a_slice_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = _settings(monkeypatch, {})
    assert train_cli.run_environment(run) == []
    lines = _printed_report(monkeypatch, run, RolloutConfig())
    assert f"  evaluate it: casi eval --policy {VERSION} --split test --queries 100" in lines
    assert f"  serve it:    CASI_API_POLICY={VERSION} casi serve" in lines
    assert train_cli.run_environment(run, max_docs=500) == ["CASI_MAX_DOCS=500"]


def test_a_guarded_run_is_evaluated_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """`casi train --eval-refuse-degenerate` (the demo's): the pasted `casi eval` decodes with the
    same guard, so it scores the rewrites the run's held-out table scored."""
    run = _settings(monkeypatch, DEMO_ENV)
    rollout = RolloutConfig(prompt="feedback")
    lines = _printed_report(monkeypatch, run, rollout, guarded=True)
    evaluate = shlex.split(next(line for line in lines if line.startswith("  evaluate it:")))
    assert evaluate[-3:] == ["--prompt", "feedback", "--refuse-degenerate"]
    unguarded = _printed_report(monkeypatch, run, rollout)
    assert not any("--refuse-degenerate" in line for line in unguarded)


def test_a_path_with_spaces_is_quoted(monkeypatch: pytest.MonkeyPatch) -> None:
    run = _settings(monkeypatch, {"CASI_VAR_DIR": "/tmp/my runs/var"})
    assert train_cli.run_environment(run) == ["CASI_VAR_DIR='/tmp/my runs/var'"]


@pytest.mark.parametrize(
    ("dataset", "word"),
    [("data/scifact", "claims"), ("data/nfcorpus", "queries"), ("/x/fiqa", "queries")],
)
def test_the_table_names_the_queries_as_the_dataset_does(dataset: str, word: str) -> None:
    assert train_cli.query_word(Path(dataset)) == word
    cfg = SimpleNamespace(eval=SimpleNamespace(split="test", queries=40))
    evals = {0: {"combined_pool_recall": 0.5}, 8: {"combined_pool_recall": 0.6}}
    with console.capture() as out:
        train_cli.print_before_after(evals, cfg, train_cli.query_word(Path(dataset)))
    assert f"held-out test (40 {word})" in out.get()
