"""A policy is prompted as it was trained: the prompt style (and the feedback context's size)
is recorded beside its weights (app.training.policy_prompt) by `casi policy warmstart` and by
`casi train`'s checkpoints, and `casi rewrite` and the API's batcher read it. End to end here:
a feedback warm start of the tiny policy on a slice of NFCorpus (pooled game, BM25, the
embedded defaults), then `casi rewrite` of it, which shows the query's feedback context."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from app.cli import app
from app.settings import get_settings
from app.training.policy_prompt import PROMPT_FILE, PolicyPrompt, read_prompt, write_prompt
from evaluator.artifacts import verify_folder
from policy.model import build_tiny_policy, save_checkpoint

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("DATABASE_URL")),
    reason="it clears DATABASE_URL and REDIS_URL and runs on the embedded defaults whatever they "
    "say: the pass without DATABASE_URL (.ci/run's second) runs it",
)


def test_a_folder_without_a_record_is_prompted_oneshot(tmp_path: Path) -> None:
    assert read_prompt(tmp_path) == PolicyPrompt("oneshot") == read_prompt(None)
    write_prompt(tmp_path, PolicyPrompt("feedback", 12))
    assert read_prompt(tmp_path) == PolicyPrompt("feedback", 12)
    (tmp_path / PROMPT_FILE).write_text('{"prompt": "chatty", "feedback_words": 3}')
    with pytest.raises(ValueError, match="not a CASI prompt record"):
        read_prompt(tmp_path)
    with pytest.raises(ValueError, match="feedback_words must be in 1..64"):
        PolicyPrompt("feedback", 0)


@pytest.fixture
def pool_env(
    nf_slice: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smol_tokenizer: Any
) -> Iterator[Path]:
    """The tiny policy in a folder; the pooled game on the NFCorpus slice, embedded defaults."""
    env = {"CASI_VAR_DIR": str(tmp_path / "var"), "CASI_DATASET": str(nf_slice),
           "CASI_THREADS": "1", "CASI_RETRIEVER": "bm25", "CASI_GAME": "pool",
           "CASI_BM25_STEMMER": "none", "CASI_RETRIEVAL_K": "5"}  # fmt: skip
    for name in ("DATABASE_URL", "REDIS_URL", "CASI_MAX_DOCS", "CASI_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield save_checkpoint(build_tiny_policy(smol_tokenizer, seed=0), smol_tokenizer, tmp_path / "t")
    get_settings.cache_clear()
    torch.set_num_threads(2)


def test_a_feedback_warm_start_records_its_prompt_and_rewrite_uses_it(
    pool_env: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ws"
    done = CliRunner().invoke(app, [
        "policy", "warmstart", "--source", "prf", "--prompt", "feedback", "--feedback-words", "8",
        "--steps", "1", "--batch-size", "2", "--queries", "2", "--n-actions", "2",
        "--policy", str(pool_env), "--out", str(out),
    ])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert json.loads((out / PROMPT_FILE).read_text()) == {
        "prompt": "feedback",
        "feedback_words": 8,
    }
    verify_folder(out, deep=True, exact=True)  # in its manifest: an export carries it
    query = "Why Deep Fried Foods May Cause Cancer"
    done = CliRunner().invoke(app, [
        "rewrite", "--query", query, "--n-actions", "2", "--line-cap", "4", "--policy", str(out),
        "--temperature", "0",
    ])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert "feedback context: " in done.output
    plain = CliRunner().invoke(app, [
        "rewrite", "--query", query, "--n-actions", "2", "--line-cap", "4", "--policy", str(out),
        "--temperature", "0", "--prompt", "short",
    ])  # fmt: skip
    assert plain.exit_code == 0, plain.output
    assert "feedback context" not in plain.output


def test_the_teacher_and_its_prompt_go_together(pool_env: Path) -> None:
    done = CliRunner().invoke(app, [
        "policy", "warmstart", "--source", "prf", "--steps", "1", "--policy", str(pool_env),
    ])  # fmt: skip
    assert done.exit_code != 0
    assert "--source prf and --prompt feedback go together" in done.output
