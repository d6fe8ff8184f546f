"""Issue 27: a cancelled GGUF conversion left an empty `.smollm2-135m-instruct.tmp-*` folder
behind. `atomic_save` removes its temporary folder on every way out (an error, Ctrl-C, a
SIGTERM that would have killed the process), and the next save of the same target removes the
folders that killed processes left; a conversion, under its build lock, removes every one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from policy import atomic_folder
from policy import model as policy_model
from policy.atomic_folder import atomic_save, remove_stale_temps
from policy.model import (
    DEFAULT_MODEL_DIRNAME,
    build_tiny_policy,
    convert_gguf,
    default_model_dir,
    save_checkpoint,
)


def _temps(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.glob(f".{name}.tmp-*"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _stale(parent: Path, name: str, owner: str) -> Path:
    """A temporary folder as an interrupted save leaves it (a half-written file inside)."""
    folder = parent / f".{name}.tmp-{owner}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, OSError], ids=lambda e: e.__name__)
def test_an_interrupted_write_leaves_no_temporary_folder(tmp_path: Path, exc: type) -> None:
    target = tmp_path / "models" / "m"
    seen: list[Path] = []

    def write(tmp: Path) -> None:
        seen.append(tmp)
        (tmp / "model.safetensors").write_bytes(b"half")
        raise exc("interrupted mid-write")

    with pytest.raises(exc):
        atomic_save(target, write)
    assert seen and seen[0].parent == target.parent  # it did write into one
    assert _temps(target.parent, "m") == [] and not target.exists()


SIGTERM_MID_WRITE = """
import os, signal, sys, time
from pathlib import Path
from policy.atomic_folder import atomic_save

def write(tmp):
    (tmp / "model.safetensors").write_bytes(b"half")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the handler raises at the next bytecode
    sys.exit(3)  # SIGTERM did not interrupt the write

try:
    atomic_save(Path(sys.argv[1]), write)
finally:
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the default action is back
"""


def test_a_sigterm_mid_write_exits_and_leaves_no_temporary_folder(tmp_path: Path) -> None:
    """A SIGTERM (a job's cancel) that would kill the process outright raises SystemExit(143)
    while the save runs, so the folder is removed on the way out (in a child process: a
    regression must not kill the test session)."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", SIGTERM_MID_WRITE, str(tmp_path / "m")],
        cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stderr[-2000:])
    assert _temps(tmp_path, "m") == [] and not (tmp_path / "m").exists()


def test_a_save_removes_the_folders_of_dead_processes_only(tmp_path: Path) -> None:
    host = atomic_folder._host_tag()
    dead = _stale(tmp_path, "m", f"{_dead_pid()}.{host}.abc")
    alive = _stale(tmp_path, "m", f"{os.getppid()}.{host}.def")  # a live process's save
    elsewhere = _stale(tmp_path, "m", f"{_dead_pid()}.00000000.ghi")  # another host's
    legacy = _stale(tmp_path, "m", "x1y2z3")  # no owner in the name: cannot tell
    other_target = _stale(tmp_path, "mm", f"{_dead_pid()}.{host}.jkl")
    atomic_save(tmp_path / "m", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert (tmp_path / "m" / "config.json").is_file()
    assert not dead.exists()
    assert alive.exists() and elsewhere.exists() and legacy.exists() and other_target.exists()
    assert _temps(tmp_path, "m") == sorted(p.name for p in (alive, elsewhere, legacy))
    # under the target's build lock nobody else writes it: every leftover is stale
    removed = remove_stale_temps(tmp_path / "m", exclusive=True)
    assert sorted(removed) == sorted([alive, elsewhere, legacy])
    assert _temps(tmp_path, "m") == [] and other_target.exists()


def test_a_conversion_removes_a_stale_folder_and_its_own_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reported case: an empty folder from a cancelled conversion is there before the next
    one; that one (interrupted too, here) leaves none behind either."""
    target = default_model_dir(tmp_path / "var")
    target.parent.mkdir(parents=True)
    stale = target.parent / f".{DEFAULT_MODEL_DIRNAME}.tmp-k3j9x0qz"  # mkdtemp's old name
    stale.mkdir()
    from transformers import AutoModelForCausalLM

    def cancelled(*_a: Any, **_k: Any) -> None:
        assert not stale.exists()  # removed before this conversion started writing
        assert len(_temps(target.parent, DEFAULT_MODEL_DIRNAME)) == 1  # its own
        raise KeyboardInterrupt

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", cancelled)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tmp_path / "model.gguf", target, progress=False)
    assert _temps(target.parent, DEFAULT_MODEL_DIRNAME) == [] and not target.exists()


def test_loading_a_sound_conversion_removes_leftovers_beside_it(
    tmp_path: Path, smol_tokenizer: Any
) -> None:
    var = tmp_path / "var"
    target = save_checkpoint(build_tiny_policy(smol_tokenizer, seed=0), smol_tokenizer,
                             default_model_dir(var))  # fmt: skip
    stale = target.parent / f".{DEFAULT_MODEL_DIRNAME}.tmp-k3j9x0qz"
    stale.mkdir()
    aside = target.parent / f".{DEFAULT_MODEL_DIRNAME}.old-{_dead_pid()}"
    aside.mkdir()
    assert policy_model._resolve(None, var, progress=False) == target
    assert not stale.exists() and not aside.exists() and target.is_dir()
