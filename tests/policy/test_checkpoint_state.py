"""The resume state is crash-safe: a process killed between writing the new state and its
manifest leaves the previous pair loadable (seen: SIGKILL between two renames made a run
"damaged"), a flipped byte is still detected, and a state from before step-named files loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from policy.checkpoint import DamagedStateError, load_state, save_state


def test_a_kill_between_the_renames_keeps_the_previous_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_state({"step": 1, "w": torch.ones(3)}, tmp_path)
    real, calls = os.replace, []

    def killed_after_first(src: object, dst: object) -> None:
        calls.append(dst)
        if len(calls) == 2:  # the manifest's rename: the process "dies" just before it
            raise KeyboardInterrupt
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        save_state({"step": 2, "w": torch.zeros(3)}, tmp_path)
    monkeypatch.setattr(os, "replace", real)
    state = load_state(tmp_path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))
    save_state({"step": 3, "w": torch.full((3,), 3.0)}, tmp_path)  # the next save cleans up
    assert load_state(tmp_path)["step"] == 3
    assert sorted(p.name for p in tmp_path.glob("state-*.pt")) == ["state-00000003.pt"]


def test_a_flipped_byte_is_still_damage(tmp_path: Path) -> None:
    target = save_state({"step": 4, "w": torch.arange(100.0)}, tmp_path)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(DamagedStateError):
        load_state(tmp_path)


def test_a_state_written_before_step_names_loads(tmp_path: Path) -> None:
    target = save_state({"step": 5, "w": torch.ones(2)}, tmp_path)
    legacy = tmp_path / "state.pt"
    target.rename(legacy)
    manifest = json.loads((tmp_path / "state.json").read_text())
    (tmp_path / "state.json").write_text(json.dumps({**manifest, "file": "state.pt"}))
    assert load_state(tmp_path)["step"] == 5
