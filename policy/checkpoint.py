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

STATE_FILE = "state.pt"  # the name before states were named by step (still read)
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
    """Write ``state`` to ``folder`` crash-safely, with a manifest (file, size, sha256, step).

    The state goes to a file named by its step and the manifest, replaced by ONE rename, is the
    commit point: a process killed at any moment leaves the previous (state, manifest) pair or
    the new one, never a new state under an old manifest (seen: SIGKILL between two renames
    made a resumable run "damaged"). States the manifest no longer names are removed after."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"state-{int(state['step']):08d}.pt"
    target, tmp = folder / name, folder / f".{name}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    manifest = {
        "file": name,
        "size": tmp.stat().st_size,
        "sha256": _sha256(tmp),
        "step": int(state["step"]),
    }
    man_tmp = folder / f".{MANIFEST_FILE}.tmp-{os.getpid()}"
    man_tmp.write_text(json.dumps(manifest))
    os.replace(tmp, target)  # not yet named by the manifest: a kill here keeps the old pair
    os.replace(man_tmp, folder / MANIFEST_FILE)  # the commit point
    for old in (*folder.glob("state-*.pt"), folder / STATE_FILE):
        if old.name != name and old.is_file():
            old.unlink(missing_ok=True)
    return target


def state_step(folder: Path) -> int | None:
    """The step of the saved state in ``folder`` (None when there is none)."""
    manifest = folder / MANIFEST_FILE
    if not manifest.is_file():
        return None
    return int(json.loads(manifest.read_text())["step"])


def load_state(folder: Path) -> dict[str, Any]:
    """The state saved in ``folder``, after checking its size and sha256 against the manifest."""
    manifest_path = folder / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    path = folder / str(manifest.get("file", STATE_FILE))  # older runs: state.pt
    if not manifest or not path.is_file():
        raise FileNotFoundError(
            f"no resume state in {folder} (expected {MANIFEST_FILE} and the state it names)"
        )
    if path.stat().st_size != manifest["size"] or _sha256(path) != manifest["sha256"]:
        raise DamagedStateError(
            f"resume state {path} is damaged (size or sha256 differs from {manifest_path}); "
            "it cannot be rebuilt — start a new run or resume from a registered checkpoint"
        )
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state
