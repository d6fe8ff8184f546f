"""CASI_THREADS is honoured by the commands that run the policy without an index: `casi
rewrite` and `casi policy warmstart` set torch's intra-op threads from it, as every command that
builds the retrieval stack does (`app.runtime.configure_threads`). Without it, torch takes one
thread per physical core, so on a larger machine a warm start would ignore the setting (and
reduce in a different order from the cells that pin 2 threads). In this process, on the tiny
policy and the SciFact slice; nothing is mocked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from app.cli import app
from app.settings import get_settings
from policy.model import build_tiny_policy, save_checkpoint


@pytest.fixture
def one_thread_env(
    slice_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """CASI_THREADS=1 with a fresh var dir (SQLite, embedded Redis); torch at 2 threads before
    the command and again after the test."""
    env = {"CASI_VAR_DIR": str(tmp_path / "var"), "CASI_DATASET": str(slice_path),
           "CASI_DEVICE": "cpu", "CASI_THREADS": "1"}  # fmt: skip
    for name in ("DATABASE_URL", "REDIS_URL", "CASI_MAX_DOCS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    torch.set_num_threads(2)
    yield tmp_path
    get_settings.cache_clear()
    torch.set_num_threads(2)


REWRITE = ["rewrite", "--query", "Vitamin D lowers the risk of fractures.", "--n-actions", "2",
           "--line-cap", "6"]  # fmt: skip
WARMSTART = ["policy", "warmstart", "--steps", "1", "--batch-size", "2", "--queries", "2",
             "--n-actions", "2"]  # fmt: skip


@pytest.mark.parametrize("command", [REWRITE, WARMSTART], ids=["rewrite", "warmstart"])
def test_policy_commands_take_their_threads_from_casi_threads(
    command: list[str], one_thread_env: Path, smol_tokenizer: Any
) -> None:
    folder = save_checkpoint(
        build_tiny_policy(smol_tokenizer, seed=0), smol_tokenizer, one_thread_env / "tiny"
    )
    assert torch.get_num_threads() == 2
    done = CliRunner().invoke(app, [*command, "--policy", str(folder)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert torch.get_num_threads() == 1
