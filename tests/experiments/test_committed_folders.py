"""Every committed protocol folder (``docs/experiments/<name>/protocol.toml``) rebuilds its own
``table.md`` and ``ndcg.png`` byte for byte from its committed cells: what the aggregate writes
today is what was committed. A folder added later is picked up by the glob, not by an edit here.

The plan-mode result in ``docs/experiments/credit`` (``plan.json``, ``results.json``) has no
protocol: it is a frozen artifact of the retired ``casi experiment credit`` without
``--protocol`` and is not rebuilt (docs/experiments.md says so)."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from app.experiments.aggregate import aggregate

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = sorted(p.parent for p in (ROOT / "docs" / "experiments").glob("*/protocol.toml"))
TABLED = [f for f in FOLDERS if (f / "table.md").is_file()]
"""The folders with an answer; a protocol whose cells have not begun has none yet."""


def test_the_committed_protocol_folders_are_found() -> None:
    assert [f.name for f in FOLDERS] == [
        "credit-pool", "credit-units", "feedback-pool", "feedback-pool-v2"
    ]  # fmt: skip
    assert [f.name for f in TABLED] == [
        "credit-pool", "credit-units", "feedback-pool", "feedback-pool-v2"
    ]  # fmt: skip
    for folder in set(FOLDERS) - set(TABLED):  # no cell committed without its table
        assert not list(folder.glob("*/*-seed*.json")), folder.name


@pytest.mark.parametrize("committed", TABLED, ids=[f.name for f in TABLED])
def test_a_committed_folder_rebuilds_its_table_and_plot_byte_for_byte(
    committed: Path, tmp_path: Path
) -> None:
    """Only what the aggregate reads is copied (the protocol and its environments' folders), so
    a table or plot it failed to write would not be found in the copy."""
    dst = tmp_path / committed.name
    dst.mkdir()
    shutil.copy2(committed / "protocol.toml", dst / "protocol.toml")
    protocol = tomllib.loads((committed / "protocol.toml").read_text(encoding="utf-8"))
    for env in protocol["environments"]:
        if (committed / env).is_dir():
            shutil.copytree(committed / env, dst / env)
    aggregate(dst)
    assert (dst / "table.md").read_bytes() == (committed / "table.md").read_bytes()
    assert (dst / "ndcg.png").read_bytes() == (committed / "ndcg.png").read_bytes()
