"""`casi experiment status PROTOCOL`: which planned cells are in, which are left, and whether this
machine can run them. A seed's cells must share one start, and the recipe makes a start bit for
bit only on one CPU microarchitecture, so the answer for a seed left half done depends on which
CPU families ran cells from its start; read off the cell files, nothing trained or built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import app
from app.experiments.protocol import load_protocol
from app.experiments.schedule import half_done_seeds, protocol_status

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "docs" / "experiments" / "credit-pool" / "protocol.toml"
MODES = ("broadcast", "shuffled", "singleton", "leave_one_out", "shapley")
ZEN4 = "AuthenticAMD family 25 model 17 stepping 1"
ZEN5 = "AuthenticAMD family 26 model 2 stepping 1"
XEON = "GenuineIntel family 6 model 167 stepping 1"
A, B = "4cdd6a0c1e7b", "66e56c080282"
IMPORT_HINT = " (`casi policy import` it from a machine that has it)"


COMMITTED = PROTOCOL.parent / "pool"


def _cell(
    folder: Path, mode: str, seed: int, version: str, family: str, made_on: str | None = None
) -> None:
    """The committed cell of (mode, seed), as begun from start ``version`` on ``family``, 10 min
    (a file the aggregate accepts: status refuses what the aggregate refuses)."""
    (folder / "pool").mkdir(parents=True, exist_ok=True)
    for start in COMMITTED.glob("start-*.json"):  # both starts' evaluations
        shutil.copyfile(start, folder / "pool" / start.name)
    data = json.loads((COMMITTED / f"{mode}-seed{seed}.json").read_text(encoding="utf-8"))
    data["start"] = {"recipe": data["start"]["recipe"], "version": version}
    if made_on is not None:  # an imported start: the family that made it
        data["start"]["made_on"] = made_on
    data["compute"]["wall_s"] = 600.0
    data["compute"]["machines"] = [{**data["compute"]["machines"][0], "cpu_family": family}]
    (folder / "pool" / f"{mode}-seed{seed}.json").write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """Seed 0 complete from start A (Zen 4); seed 2 without its Shapley cell, from A (Zen 4);
    seed 3 begun from B on a Xeon; seed 4's two cells name two starts; seeds 1 and 5 empty."""
    for mode in MODES:
        _cell(tmp_path, mode, 0, A, ZEN4)
    for mode in MODES[:4]:
        _cell(tmp_path, mode, 2, A, ZEN4)
    _cell(tmp_path, "broadcast", 3, B, XEON)
    _cell(tmp_path, "broadcast", 4, A, ZEN4)
    _cell(tmp_path, "shapley", 4, B, XEON)
    return tmp_path


def _status(
    folder: Path, family: str | None, local: tuple[str, ...] = ()
) -> dict[int, tuple[str, tuple[str, ...], str]]:
    rows = protocol_status(folder, load_protocol(PROTOCOL), family, local)
    assert [r.seed for r in rows] == list(range(6)) and {r.environment for r in rows} == {"pool"}
    return {r.seed: (r.here, r.missing, r.reason) for r in rows}


def test_each_seed_says_what_is_left_and_who_can_run_it(results: Path) -> None:
    on_zen4 = _status(results, ZEN4)
    assert on_zen4[0] == ("done", (), "every planned cell is in")
    assert on_zen4[1][:2] == ("yes", MODES)  # not begun: any machine begins it from its start
    assert on_zen4[2] == ("yes", ("shapley",), f"this CPU family made start {A}")
    assert on_zen4[3][:2] == ("no", MODES[1:])  # Zen 4 made A, the seed began from B
    assert on_zen4[3][2] == f"this CPU family makes start {A}, not {B}{IMPORT_HINT}"
    assert on_zen4[4][0] == "broken" and A in on_zen4[4][2] and B in on_zen4[4][2]
    on_xeon = _status(results, XEON)
    assert on_xeon[2] == (
        "no", ("shapley",), f"this CPU family makes start {B}, not {A}{IMPORT_HINT}"
    )  # fmt: skip
    assert on_xeon[3][0] == "yes"
    on_zen5 = _status(results, ZEN5)  # no cell from Zen 5 yet: only building the start tells
    assert on_zen5[2][0] == on_zen5[3][0] == "unknown"
    assert (
        on_zen5[2][2]
        == f"no cell from this CPU family yet: build the start and compare it with {A}"
    )
    assert _status(results, None)[2][0] == "unknown"  # no /proc/cpuinfo: nothing is claimed


def test_a_start_imported_here_lets_any_family_finish_its_seeds(results: Path) -> None:
    """A Xeon holding start A (`casi policy import`) can finish seed 2; a cell it runs from the
    imported start names A's maker, so the Xeon is not taken for a family that makes A."""
    assert _status(results, XEON, (A,))[2] == (
        "yes", ("shapley",), f"start {A} is on this machine (var/models/recipes)"
    )  # fmt: skip
    assert _status(results, XEON, (A,))[3][0] == "yes"  # its own start B: as before
    _cell(results, "shapley", 2, A, XEON, made_on=ZEN4)
    rows = {r.seed: r for r in protocol_status(results, load_protocol(PROTOCOL), XEON)}
    assert rows[2].here == "done" and rows[2].made_on == (ZEN4,)
    assert rows[3].here == "yes" and rows[1].here == "yes"
    _cell(results, "broadcast", 1, A, ZEN4)  # seed 1 begun from A on a Zen 4
    on_other_xeon = _status(results, XEON)  # no import there: the Xeon still makes B, not A
    assert on_other_xeon[1] == (
        "no", MODES[1:], f"this CPU family makes start {B}, not {A}{IMPORT_HINT}"
    )  # fmt: skip


def test_the_half_done_seeds_of_a_start_are_the_ones_to_pass_on(results: Path) -> None:
    """What `casi experiment credit` tells a machine to export before it goes: the asked seeds
    begun from its start with planned cells left (seed 4 names both starts)."""
    env = load_protocol(PROTOCOL).environment("pool")
    assert half_done_seeds(results, env, list(range(6)), A) == [2, 4]
    assert half_done_seeds(results, env, list(range(6)), B) == [3, 4]
    assert half_done_seeds(results, env, [0, 1, 5], A) == []  # done, or not begun


def test_the_seed_rows_name_the_start_and_every_family_that_made_it(results: Path) -> None:
    _cell(results, "singleton", 1, A, ZEN5)  # seed 1 began on Zen 5 from the same start A
    rows = {r.seed: r for r in protocol_status(results, load_protocol(PROTOCOL), ZEN5)}
    assert rows[2].start == A and rows[2].made_on == (ZEN4, ZEN5)
    assert rows[2].here == "yes"  # Zen 5 made A too (seed 1's cell), so it can finish seed 2
    assert rows[2].done == MODES[:4]
    assert rows[5].start is None and rows[5].made_on == ()


def _run(args: list[str], family: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The command, as a machine of ``family`` (the var folder: `cli_var`'s)."""
    import app.cli.experiment as status

    info = {**status.machine_info(), "cpu_family": family}
    monkeypatch.setattr(status, "machine_info", lambda: info)
    monkeypatch.setenv("COLUMNS", "250")
    done = CliRunner().invoke(app, ["experiment", "status", *args])
    assert done.exit_code == 0, done.output
    return done.output


def test_the_command_prints_what_this_machine_can_run(
    results: Path, cli_var: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _run([str(PROTOCOL), "--out", str(results)], XEON, monkeypatch)
    assert "12 of 30 planned cells in" in out
    assert f"this machine: {XEON}" in out
    assert "pool: 18 cells left; a cell here takes about 12 min" in out  # 1.25 × 600 s
    base = f"casi experiment credit --protocol {PROTOCOL} --out {results} --environment pool"
    assert f"{base} --seeds 1,5\n" in out  # every mode left: no --modes
    assert f"{base} --seeds 3 --modes shuffled singleton leave_one_out shapley" in out
    assert "--seeds 2" not in out and "--seeds 4" not in out  # another start; two starts
    out = _run([str(PROTOCOL), "--out", str(results)], ZEN5, monkeypatch)
    assert (
        "build the start and compare its version: CASI_DATASET=data/nfcorpus casi policy warmstart"
        in out
    )
    # start A imported on the Xeon (`casi policy import` writes recipes/<recipe>@<version>):
    recipes, folder = cli_var / "models" / "recipes", cli_var / "models" / f"warmstart-{A}"
    recipes.mkdir(parents=True)
    folder.mkdir()
    (recipes / f"{'0' * 16}@{A}").write_text(json.dumps({"folder": str(folder), "made_on": ZEN4}))
    out = _run([str(PROTOCOL), "--out", str(results)], XEON, monkeypatch)
    assert f"{base} --seeds 2 --modes shapley" in out
    assert f"warm starts on this machine (made or imported): {A}" in out


def test_the_committed_experiment_and_a_missing_protocol(
    cli_var: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _run([str(PROTOCOL)], XEON, monkeypatch)  # the committed cells, in the protocol's folder
    assert "protocol credit-pool-v1" in out and " of 30 planned cells in" in out
    done = CliRunner().invoke(app, ["experiment", "status", "/nonexistent/protocol.toml"])
    assert done.exit_code == 2
    assert "no protocol file /nonexistent/protocol.toml" in done.output
