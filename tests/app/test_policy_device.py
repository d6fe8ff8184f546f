"""`casi rewrite`, `casi policy warmstart`, `casi step` and `casi estimate` load the policy on
CASI_DEVICE (`Settings.resolved_device()`), as `casi train` and `casi eval` do: they loaded it
on the CPU whatever CASI_DEVICE said, while their `auto` precision was resolved for the CUDA
device (a warm start in emulated bf16 on the CPU, a probe timing the wrong device, a step
sampling on the CPU beside a scorer on CUDA).

This machine has no CUDA. With CASI_DEVICE=cpu every command runs as before (and in
test_cli_threads.py); to see where the policy goes, torch is told CUDA is present
(``torch.cuda.is_available``, torch's own function, not CASI's): the command then moves the
policy to CUDA while loading it, which a CPU-only torch refuses ("Torch not compiled with CUDA
enabled"); a command that ignored CASI_DEVICE loaded it on the CPU, and failed later, if at all
(the embedder, the machine description), never in the policy's load. `casi step` builds the
embedder on CASI_DEVICE before it loads the policy, so this cannot reach its policy load: it is
run on the CPU only. Running on a real GPU
is not covered here. In this process, on the tiny policy and the SciFact slice."""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from app.cli import app
from app.settings import get_settings
from policy.model import build_tiny_policy, save_checkpoint

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("DATABASE_URL")),
    reason="it clears DATABASE_URL and REDIS_URL and runs on the embedded defaults whatever they "
    "say: the pass without DATABASE_URL (.ci/run's second) runs it",
)

COMMANDS = {
    "rewrite": ["rewrite", "--query", "Vitamin D lowers the risk of fractures.", "--n-actions",
                "2", "--line-cap", "6"],
    "warmstart": ["policy", "warmstart", "--steps", "1", "--batch-size", "2", "--queries", "2",
                  "--n-actions", "2"],
    "estimate": ["estimate", "--queries", "1", "--samples", "1", "--precision", "float32"],
    "step": ["step", "--queries", "1", "--samples", "2", "--n-actions", "2", "--max-docs", "20",
             "--line-cap", "4"],
}  # fmt: skip


@pytest.fixture
def tiny(
    slice_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smol_tokenizer: Any
) -> Iterator[Path]:
    """The tiny policy in a folder; a fresh var dir (SQLite, embedded Redis), bm25, 1 thread."""
    env = {"CASI_VAR_DIR": str(tmp_path / "var"), "CASI_DATASET": str(slice_path),
           "CASI_THREADS": "1", "CASI_RETRIEVER": "bm25"}  # fmt: skip
    for name in ("DATABASE_URL", "REDIS_URL", "CASI_MAX_DOCS", "CASI_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield save_checkpoint(build_tiny_policy(smol_tokenizer, seed=0), smol_tokenizer, tmp_path / "t")
    get_settings.cache_clear()
    torch.set_num_threads(2)


@pytest.mark.parametrize("name", ["estimate", "rewrite", "warmstart"])
def test_the_policy_is_loaded_on_casi_device(
    name: str, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    command = [*COMMANDS[name], "--policy", str(tiny)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device in ("cuda", "auto"):  # auto: CUDA where present
        monkeypatch.setenv("CASI_DEVICE", device)
        get_settings.cache_clear()
        done = CliRunner().invoke(app, command)
        assert done.exit_code != 0, (device, done.output)
        assert "not compiled with CUDA" in str(done.exception), (device, repr(done.exception))
        frames = [f.name for f in traceback.extract_tb(done.exception.__traceback__)]
        assert "load_policy_ref" in frames, (device, frames)  # the policy's load moved it


@pytest.mark.parametrize("name", ["estimate", "step"])
def test_casi_device_cpu_still_runs(name: str, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # present, but not asked for
    monkeypatch.setenv("CASI_DEVICE", "cpu")
    get_settings.cache_clear()
    done = CliRunner().invoke(app, [*COMMANDS[name], "--policy", str(tiny)])
    assert done.exit_code == 0, done.output
