"""Issue 51, items 9 and 10: what the aggregate refuses, every reader refuses, naming the file.

Item 9: `casi experiment status` counted cells by file name, so it said "30 of 30 … done" for a
folder the aggregate refuses (a file that is not JSON, a cell copied under another mode, nDCG
7.0, a seed the protocol does not plan, a ``.v2`` copy). It now runs the aggregate's own
checks (`app.experiments.results_folder.refusals`), names every refused file and never calls
its seed done.

Item 10: the aggregate accepted a cell whose ``steps`` list was empty or short (its config
trains 24), read an environment path that is a file as an empty environment, and passed over a
folder of cells the protocol does not name. Each is refused, naming the file or folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import app
from app.experiments.aggregate import aggregate
from app.experiments.protocol import load_protocol
from app.experiments.results_folder import refusals
from app.experiments.schedule import protocol_status
from tests.experiments.test_results_folder import ROOT, STALE, _edit

COMMITTED = ROOT / "docs" / "experiments" / "credit-pool"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A copy of the committed pooled results: protocol, its one environment, table and plot."""
    dst = tmp_path / "credit-pool"
    dst.mkdir()
    for name in ("protocol.toml", "table.md", "ndcg.png"):
        shutil.copyfile(COMMITTED / name, dst / name)
    shutil.copytree(COMMITTED / "pool", dst / "pool")
    return dst


def _break_five(folder: Path) -> dict[str, str]:
    """Five files the aggregate refuses → the start of each one's refusal."""
    pool = folder / "pool"
    (pool / "shuffled-seed1.json").write_text("{ not json", encoding="utf-8")
    shutil.copyfile(pool / "shapley-seed2.json", pool / "singleton-seed2.json")  # copied mode
    _edit(pool / "broadcast-seed3.json", lambda d: d["ndcg@10"].__setitem__(0, 7.0))
    extra = pool / "shapley-seed9.json"  # a seed the protocol does not plan (0-5)
    shutil.copyfile(pool / "shapley-seed5.json", extra)
    _edit(extra, lambda d: (d.update(seed=9), d["config"].update(seed=9)))
    shutil.copyfile(pool / "shapley-seed4.json", pool / "shapley-seed4.json.v2")
    return {
        "pool/shuffled-seed1.json": "pool/shuffled-seed1.json is not a readable result file",
        "pool/singleton-seed2.json": "pool/singleton-seed2.json: holds cell shapley-seed2, so "
        "its name must be shapley-seed2.json",
        "pool/broadcast-seed3.json": "pool/broadcast-seed3.json: field 'ndcg@10'[0] = 7.0 is "
        "outside [0, 1]",
        "pool/shapley-seed9.json": "pool/shapley-seed9.json: seed 9 is outside the protocol's "
        "plan for pool (seeds 0-5)",
        "pool/shapley-seed4.json.v2": "pool/shapley-seed4.json.v2: not a result file",
    }


def test_the_committed_folder_has_nothing_to_refuse(folder: Path) -> None:
    protocol = load_protocol(folder / "protocol.toml")
    assert refusals(folder, protocol) == []
    assert {r.here for r in protocol_status(folder, protocol, None)} == {"done"}


def test_status_names_every_file_the_aggregate_refuses(
    folder: Path, cli_var: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _break_five(folder)
    protocol = load_protocol(folder / "protocol.toml")
    found = refusals(folder, protocol)
    assert sorted(label for label, _ in found) == sorted(expected)
    for label, message in found:
        assert message.startswith(expected[label]), message
    rows = {r.seed: r for r in protocol_status(folder, protocol, None, refused=found)}
    assert {s for s, r in rows.items() if r.here == "broken"} == {1, 2, 3}  # never "done"
    assert rows[2].reason == "the aggregate refuses pool/singleton-seed2.json"
    with pytest.raises(ValueError):  # the aggregate refuses the same folder
        aggregate(folder)
    monkeypatch.setenv("COLUMNS", "400")
    done = CliRunner().invoke(app, ["experiment", "status", str(folder / "protocol.toml")])
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())  # as printed, less the console's line breaks
    assert "30 of 30 planned cells in; the aggregate refuses 5 of its files" in text
    for start in expected.values():
        assert start in text


def _refused(folder: Path, message: str) -> None:
    """The aggregate of ``folder`` is refused with exactly ``message`` and writes nothing; the
    status names the same problem."""
    (folder / "table.md").write_text(STALE, encoding="utf-8")
    png = (folder / "ndcg.png").read_bytes()
    with pytest.raises(ValueError) as info:
        aggregate(folder)
    assert str(info.value) == message
    assert (folder / "table.md").read_text(encoding="utf-8") == STALE
    assert (folder / "ndcg.png").read_bytes() == png
    found = refusals(folder, load_protocol(folder / "protocol.toml"))
    assert [m for _, m in found] == [message]


@pytest.mark.parametrize("kept", [0, 20])
def test_a_cell_with_an_empty_or_short_steps_list_is_refused(kept: int, folder: Path) -> None:
    """Before: accepted, and its |advantage| column changed under a 6-seed label."""
    _edit(folder / "pool" / "shapley-seed0.json", lambda d: d.update(steps=d["steps"][:kept]))
    _refused(
        folder,
        f"pool/shapley-seed0.json: field 'steps' has {kept} entries, but its config trains 24 "
        "steps: a cell's file holds every step it trained",
    )


def test_an_environment_path_that_is_a_file_is_refused(folder: Path) -> None:
    """Before: read as an environment with no cells (a table of nothing, written)."""
    shutil.rmtree(folder / "pool")
    (folder / "pool").write_text("", encoding="utf-8")
    _refused(
        folder,
        "pool: not a folder; environment pool's results are the files "
        "pool/<mode>-seed<K>.json and start-<version>.json (move pool elsewhere)",
    )


def test_a_folder_of_cells_the_protocol_does_not_name_is_refused(folder: Path) -> None:
    """Before: passed over, its cells in no table. Other folders (selection/) stay allowed."""
    shutil.copytree(folder / "pool", folder / "pool-old")
    (folder / "selection").mkdir()
    (folder / "selection" / "dev-runs.json").write_text("{}", encoding="utf-8")
    _refused(
        folder,
        "pool-old/: holds result files, but the protocol credit-pool-v1 has no environment "
        "'pool-old' (it has pool): move the folder out of the results folder, or run it under "
        "a protocol that names it",
    )
