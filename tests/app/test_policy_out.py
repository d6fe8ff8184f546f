"""`casi policy warmstart --out DIR` and `casi policy merge … --out DIR` never replace a folder
the user points at: saving a checkpoint renames a fresh folder onto the target and removes
what was there, so `--out var` or `--out ~/models` wiped the database, the indexes or the
user's files. An existing --out is used only when it is empty or already holds this very
version's checkpoint (then it is reused); anything else is one `error:` line (exit 2), nothing
changed. The default folders under var/models keep being reused by a rerun of the same recipe.

In this process, on the tiny policy (1 SFT step on 2 queries of the SciFact slice), real
SQLite; nothing is mocked."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from app.cli import app
from app.settings import get_settings
from app.training.warmstart import VERSION_FILE, folder_version
from policy.model import build_tiny_policy, policy_version, save_checkpoint
from policy.params import ParamsConfig, prepare_params, save_adapter

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("DATABASE_URL")),
    reason="it clears DATABASE_URL and REDIS_URL and runs on the embedded defaults whatever they "
    "say: the pass without DATABASE_URL (.ci/run's second) runs it",
)

WARMSTART = ["policy", "warmstart", "--steps", "1", "--batch-size", "2", "--queries", "2",
             "--n-actions", "2"]  # fmt: skip


@pytest.fixture
def env(slice_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh var dir (SQLite) on the slice, CPU, one thread."""
    values = {"CASI_VAR_DIR": str(tmp_path / "var"), "CASI_DATASET": str(slice_path),
              "CASI_DEVICE": "cpu", "CASI_THREADS": "1"}  # fmt: skip
    for name in ("DATABASE_URL", "REDIS_URL", "CASI_MAX_DOCS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()
    torch.set_num_threads(2)


@pytest.fixture
def tiny(env: Path, smol_tokenizer: Any) -> Path:
    return save_checkpoint(build_tiny_policy(smol_tokenizer, seed=0), smol_tokenizer, env / "tiny")


def _run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _one_error(done: Any) -> str:
    errors = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert done.exit_code == 2 and len(errors) == 1, done.output
    assert "Traceback" not in done.output, done.output
    return " ".join(done.output.split())


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_warmstart_never_replaces_a_folder_of_the_user(env: Path, tiny: Path) -> None:
    mine = env / "mine"
    (mine / "precious").mkdir(parents=True)
    (mine / "precious" / "notes.txt").write_text("x")
    (mine / "casi.db").write_text("not a checkpoint")
    before, mode = _files(mine), mine.stat().st_mode
    text = _one_error(_run(*WARMSTART, "--policy", str(tiny), "--out", str(mine)))
    assert f"error: {mine} exists and is not empty (--out) — choose another --out" in text
    assert _files(mine) == before and mine.stat().st_mode == mode
    assert not (env / "var" / "models").is_dir() or not any(
        (env / "var" / "models").glob("warmstart-*")
    )  # refused before any training
    a_file = env / "a-file"
    a_file.write_text("keep me")
    _one_error(_run(*WARMSTART, "--policy", str(tiny), "--out", str(a_file)))
    assert a_file.read_text() == "keep me"


def test_warmstart_out_is_reused_for_its_version_and_refused_for_another(
    env: Path, tiny: Path
) -> None:
    out = env / "out"
    out.mkdir()  # an empty folder is free
    done = _run(*WARMSTART, "--policy", str(tiny), "--out", str(out))
    assert done.exit_code == 0, done.output
    version = folder_version(out)
    assert version is not None and "(saved, version" in done.output
    saved = _files(out)
    again = _run(*WARMSTART, "--policy", str(tiny), "--out", str(out))  # the same recipe
    assert again.exit_code == 0, again.output
    assert f"checkpoint {out} (reused, version {version}" in " ".join(again.output.split())
    assert _files(out) == saved
    # another recipe (another seed: other weights) into the same folder: refused, kept
    other = _one_error(_run(*WARMSTART, "--policy", str(tiny), "--out", str(out), "--seed", "1"))
    assert f"error: {out} holds version {version}, not " in other and "(--out)" in other
    assert _files(out) == saved
    # a checkpoint of this version with something else in it is not reused blindly either:
    # a damaged one (a flipped weight byte) is refused, never rewritten
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    damaged = _one_error(_run(*WARMSTART, "--policy", str(tiny), "--out", str(out)))
    assert f"holds a damaged checkpoint of version {version}" in damaged
    assert weights.read_bytes() == bytes(data)


def test_the_default_warmstart_folder_is_still_reused(env: Path, tiny: Path) -> None:
    done = _run(*WARMSTART, "--policy", str(tiny))
    assert done.exit_code == 0, done.output
    (folder,) = (env / "var" / "models").glob("warmstart-*")
    assert (folder / VERSION_FILE).is_file()
    # the recipe index forgotten: the rerun trains again and keeps the folder it finds there
    for entry in (env / "var" / "models" / "recipes").iterdir():
        if entry.is_file() and not entry.name.endswith(".lock"):
            entry.unlink()
    again = _run(*WARMSTART, "--policy", str(tiny))
    assert again.exit_code == 0, again.output
    assert f"checkpoint {folder} (reused" in " ".join(again.output.split())


def _adapter(tiny: Path, smol_tokenizer: Any, folder: Path) -> Path:
    base = build_tiny_policy(smol_tokenizer, seed=0)
    peft = prepare_params(base, ParamsConfig(kind="lora", lora_rank=2), None).peft
    save_adapter(peft, folder, str(tiny), policy_version(base))
    smol_tokenizer.save_pretrained(folder)  # as the trainer's adapter checkpoints hold it
    return folder


def test_merge_never_replaces_a_folder_of_the_user(
    env: Path, tiny: Path, smol_tokenizer: Any
) -> None:
    adapter = _adapter(tiny, smol_tokenizer, env / "adapter")
    mine = env / "mine"
    (mine / "precious").mkdir(parents=True)
    (mine / "precious" / "notes.txt").write_text("x")
    before = _files(mine)
    text = _one_error(_run("policy", "merge", str(adapter), "--out", str(mine)))
    assert f"{mine} exists and is not empty (--out) — choose another --out" in text
    assert _files(mine) == before
    # the adapter's own folder as --out: refused, the adapter kept
    adapter_files = _files(adapter)
    _one_error(_run("policy", "merge", str(adapter), "--out", str(adapter)))
    assert _files(adapter) == adapter_files
    # another version's checkpoint there: refused after the merge, kept
    other = env / "other"
    other_model = build_tiny_policy(smol_tokenizer, seed=1)
    held = policy_version(other_model)
    save_checkpoint(other_model, smol_tokenizer, other, extra_files={VERSION_FILE: held + "\n"})
    kept = _files(other)
    text = _one_error(_run("policy", "merge", str(adapter), "--out", str(other)))
    assert f"{other} holds version {held}, not " in text
    assert _files(other) == kept
    # a new folder: merged; the same merge again: that folder reused as it is
    out = env / "merged"
    done = _run("policy", "merge", str(adapter), "--out", str(out))
    assert done.exit_code == 0, done.output
    merged = _files(out)
    assert folder_version(out) is not None
    again = _run("policy", "merge", str(adapter), "--out", str(out))
    assert again.exit_code == 0, again.output
    assert _files(out) == merged
    # the default folder beside the adapter: a rerun keeps working
    for _ in range(2):
        done = _run("policy", "merge", str(adapter))
        assert done.exit_code == 0, done.output
    assert folder_version(env / "adapter-merged") == folder_version(out)
