"""The resume state of a training run on disk: `Trainer.state_dict()` written atomically.

Read `save_state` / `load_state`. The state (weights, value head, optimizer, scheduler, KL
controller, counters, torch RNG, step) is one `torch.save` file written to a temporary name and
renamed, with a sha256 beside it; `load_state` refuses a file whose size or hash does not match
(a resume state cannot be rebuilt: a damaged one must never be used silently). The weights of
the policy versions a run registers are separate (`policy.model.save_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.pt"
MANIFEST_FILE = "state.json"
HASH_CHUNK = 1 << 22  # 4 MiB reads when hashing


class DamagedStateError(RuntimeError):
    """A resume state whose size or content hash does not match its manifest."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def save_state(state: dict[str, Any], folder: Path) -> Path:
    """Write ``state`` to ``folder/state.pt`` atomically, with a manifest (size, sha256, step)."""
    folder.mkdir(parents=True, exist_ok=True)
    target, tmp = folder / STATE_FILE, folder / f".{STATE_FILE}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    manifest = {
        "file": STATE_FILE,
        "size": tmp.stat().st_size,
        "sha256": _sha256(tmp),
        "step": int(state["step"]),
    }
    man_tmp = folder / f".{MANIFEST_FILE}.tmp-{os.getpid()}"
    man_tmp.write_text(json.dumps(manifest))
    os.replace(tmp, target)  # the state first: a manifest never describes a missing file
    os.replace(man_tmp, folder / MANIFEST_FILE)
    return target


def state_step(folder: Path) -> int | None:
    """The step of the saved state in ``folder`` (None when there is none)."""
    manifest = folder / MANIFEST_FILE
    if not manifest.is_file():
        return None
    return int(json.loads(manifest.read_text())["step"])


def load_state(folder: Path) -> dict[str, Any]:
    """The state saved in ``folder``, after checking its size and sha256 against the manifest."""
    path, manifest_path = folder / STATE_FILE, folder / MANIFEST_FILE
    if not path.is_file() or not manifest_path.is_file():
        raise FileNotFoundError(
            f"no resume state in {folder} (expected {STATE_FILE} and {MANIFEST_FILE})"
        )
    manifest = json.loads(manifest_path.read_text())
    if path.stat().st_size != manifest["size"] or _sha256(path) != manifest["sha256"]:
        raise DamagedStateError(
            f"resume state {path} is damaged (size or sha256 differs from {manifest_path}); "
            "it cannot be rebuilt — start a new run or resume from a registered checkpoint"
        )
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state
