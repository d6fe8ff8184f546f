"""`casi experiment credit --protocol … --stop-by HH:MM`: a cell starts only if it should end by
then. The estimate is `CELL_TIME_MARGIN` × the longest finished cell of this CPU family (of any
machine when this family has none; none at all: the cell runs, it is how one learns), read from
the cell files themselves, so a session that must end at a given time never leaves a cell half
trained. And a seed whose finished cells began from another start (another CPU's build of the
recipe) is refused before any cell trains: the aggregate would refuse its cell."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from app.cli import app
from app.experiments.schedule import (
    CELL_TIME_MARGIN,
    CellEstimate,
    cell_estimate,
    cells_to_fit,
    check_seed_start,
    fits_before,
    parse_stop_by,
    plan_cell,
    seed_starts,
)
from app.experiments.start import Start

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "docs" / "experiments" / "credit-pool" / "protocol.toml"
NOW = datetime(2026, 12, 5, 8, 30, 15)
ZEN4 = "AuthenticAMD family 25 model 17 stepping 1"
ZEN3 = "AuthenticAMD family 25 model 1 stepping 1"
ZEN5 = "AuthenticAMD family 26 model 2 stepping 1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("08:50", datetime(2026, 12, 5, 8, 50)),
        (" 8:50 ", datetime(2026, 12, 5, 8, 50)),
        ("08:30", datetime(2026, 12, 6, 8, 30)),  # already past today: tomorrow
        ("00:05", datetime(2026, 12, 6, 0, 5)),
        ("2026-12-05T09:10", datetime(2026, 12, 5, 9, 10)),
        ("2026-12-07 01:00", datetime(2026, 12, 7, 1, 0)),
    ],
)
def test_stop_by_is_a_time_of_day_or_a_date_time(text: str, expected: datetime) -> None:
    assert parse_stop_by(text, NOW) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("24:00", "no such time of day"),
        ("8:61", "no such time of day"),
        ("8.50", "give HH:MM (local time) or an ISO date-time"),
        ("", "give HH:MM (local time) or an ISO date-time"),
        ("soon", "give HH:MM (local time) or an ISO date-time"),
        ("2026-12-05T08:00", "is already past (now 2026-12-05 08:30)"),
    ],
)
def test_a_bad_stop_by_says_why(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        parse_stop_by(text, NOW)


def _cell(folder: Path, name: str, wall_s: float, *families: str) -> None:
    machines = [{"cpu_family": f, "cpu_model": "AMD EPYC"} for f in families]
    (folder / "pool").mkdir(parents=True, exist_ok=True)
    data = {"compute": {"wall_s": wall_s, "train_s": wall_s - 60, "machines": machines}}
    (folder / "pool" / name).write_text(json.dumps(data))


def test_the_estimate_is_the_longest_cell_of_this_cpu_family(tmp_path: Path) -> None:
    _cell(tmp_path, "broadcast-seed0.json", 600.0, ZEN4)
    _cell(tmp_path, "shapley-seed0.json", 900.0, ZEN4)
    _cell(tmp_path, "shuffled-seed3.json", 1100.0, ZEN3)
    _cell(tmp_path, "singleton-seed4.json", 5000.0, ZEN4, ZEN3)  # resumed on another family
    (tmp_path / "pool" / "start-4cdd6a0c1e7b.json").write_text(
        json.dumps({"compute": {"eval_s": 9000.0, "machine": {"cpu_family": ZEN4}}})
    )
    (tmp_path / "pool" / "leave_one_out-seed1.json").write_text("{not json")  # skipped
    zen4 = cell_estimate(tmp_path, "pool", ZEN4)
    assert zen4.seconds == pytest.approx(CELL_TIME_MARGIN * 900.0)
    assert zen4.basis == "1.25 × the longest of 2 finished cells on this CPU family, 15.0 min"
    zen3 = cell_estimate(tmp_path, "pool", ZEN3)
    assert zen3.seconds == pytest.approx(CELL_TIME_MARGIN * 1100.0)


def test_without_a_cell_of_this_family_the_estimate_takes_any_machine(tmp_path: Path) -> None:
    _cell(tmp_path, "broadcast-seed0.json", 600.0, ZEN4)
    _cell(tmp_path, "shapley-seed0.json", 960.0, ZEN3)
    intel = cell_estimate(tmp_path, "pool", "GenuineIntel family 6 model 167 stepping 1")
    assert intel.seconds == pytest.approx(CELL_TIME_MARGIN * 960.0)
    assert "other machines (none of this CPU family), 16.0 min" in intel.basis
    assert cell_estimate(tmp_path, "pool", None).seconds == pytest.approx(1200.0)


def test_without_any_cell_there_is_nothing_to_estimate(tmp_path: Path) -> None:
    assert cell_estimate(tmp_path, "pool", ZEN4) == CellEstimate(
        None, "no finished cell to estimate from"
    )


def test_a_cell_starts_only_if_it_ends_by_the_stop_time() -> None:
    stop = datetime(2026, 12, 5, 9, 0, 15)
    thirty = CellEstimate(1800.0, "x")
    assert fits_before(stop, thirty, NOW)  # ends 09:00:15 exactly
    assert not fits_before(stop, CellEstimate(1801.0, "x"), NOW)
    assert fits_before(None, CellEstimate(1e9, "x"), NOW)
    assert fits_before(stop, CellEstimate(None, "no finished cell"), NOW)


def test_a_seed_is_begun_only_if_all_its_asked_cells_fit(tmp_path: Path) -> None:
    """A session that runs out of time mid-seed leaves a seed that only a machine making the
    same start can finish (credit-pool's seed 2 waited for a Zen 4): so a seed with no finished
    cell is begun only whole; a begun seed goes on cell by cell."""
    _started(tmp_path, "broadcast-seed2.json", "4cdd6a0c1e7b", ZEN4)
    cells = [(m, s) for s in (2, 3) for m in ("broadcast", "shuffled", "shapley")]
    # seed 2's broadcast is in, its other cells one by one; seed 3 all three or not at all
    assert [cells_to_fit(tmp_path, "pool", cells, i) for i in range(4)] == [0, 1, 1, 3]
    # as seed 3's cells land one by one (the same run), it is begun: one cell at a time
    _started(tmp_path, "broadcast-seed3.json", "66e56c080282", ZEN3)
    assert [cells_to_fit(tmp_path, "pool", cells, i) for i in (3, 4, 5)] == [0, 1, 1]
    # asked for one mode only, an unbegun seed is that one cell
    assert cells_to_fit(tmp_path, "pool", [("shapley", 5)], 0) == 1
    stop = datetime(2026, 12, 5, 9, 0, 15)
    assert fits_before(stop, CellEstimate(600.0, "x"), NOW, 3)  # ends 09:00:15 exactly
    assert not fits_before(stop, CellEstimate(601.0, "x"), NOW, 3)


def _plan(folder: Path, cells: list[tuple[str, int]], fits_up_to: int) -> list[tuple[str, int]]:
    """The run loop's decisions (as `run_protocol_cells` takes them) when ``fits_up_to`` more
    cells would end in time; a cell that runs writes its file."""
    put_off: set[int] = set()
    out = []
    for i, (mode, seed) in enumerate(cells):
        action, need = plan_cell(folder, "pool", cells, i, put_off, lambda n: n <= fits_up_to)
        out.append((action, need))
        if action == "put_off":
            put_off.add(seed)
        elif action == "stop":
            break
        elif action == "run" and need:
            _started(folder, f"{mode}-seed{seed}.json", "66e56c080282", ZEN3)
    return out


def test_a_seed_that_does_not_fit_whole_is_put_off_and_later_begun_seeds_go_on(
    tmp_path: Path,
) -> None:
    _started(tmp_path, "broadcast-seed4.json", "66e56c080282", ZEN3)  # seed 4 begun
    cells = [(m, s) for s in (3, 4) for m in ("broadcast", "shuffled", "shapley")]
    assert _plan(tmp_path, cells, 2) == [
        ("put_off", 3), ("skip", 0), ("skip", 0),  # seed 3: 3 cells, 2 fit: none begun
        ("run", 0), ("run", 1), ("run", 1),  # seed 4 begun: its cells one by one
    ]  # fmt: skip
    assert not (tmp_path / "pool" / "shuffled-seed3.json").exists()
    assert _plan(tmp_path, cells, 3)[:3] == [("run", 3), ("run", 1), ("run", 1)]
    fresh = tmp_path / "fresh"
    assert _plan(fresh, [("shapley", 2), ("broadcast", 5)], 0) == [("stop", 1)]


def test_without_a_protocol_the_command_is_retired_in_one_line(cli_var: Path) -> None:
    """The plan-mode experiment (no --protocol) is retired: one line naming the protocol
    command, before anything is opened (issue 52)."""
    for extra in ([], ["--stop-by", "08:50"], ["--steps", "2", "--seeds", "0-1"]):
        done = CliRunner().invoke(app, ["experiment", "credit", *extra])
        assert done.exit_code == 2, done.output
        assert done.output == (
            "error: `casi experiment credit` without --protocol is retired — run the cells of a "
            "pre-registered protocol: `casi experiment credit --protocol PROTOCOL.toml "
            "--environment ENV` (docs/experiments.md)\n"
        )
    assert not (cli_var / "casi.db").exists()


def test_a_bad_stop_by_is_refused_before_anything_is_opened(cli_var: Path) -> None:
    done = CliRunner().invoke(
        app,
        ["experiment", "credit", "--protocol", str(PROTOCOL), "--environment", "pool",
         "--seeds", "4", "--stop-by", "25:00"],
    )  # fmt: skip
    assert done.exit_code == 2, done.output
    assert "--stop-by '25:00': no such time of day" in " ".join(done.output.split())
    assert not (cli_var / "casi.db").exists()


def _started(folder: Path, name: str, version: str, family: str) -> None:
    (folder / "pool").mkdir(parents=True, exist_ok=True)
    data = {"start": {"version": version}, "compute": {"machines": [{"cpu_family": family}]}}
    (folder / "pool" / name).write_text(json.dumps(data))


def test_a_seed_begun_from_another_start_is_refused_naming_its_machines(tmp_path: Path) -> None:
    _started(tmp_path, "broadcast-seed2.json", "4cdd6a0c1e7b", ZEN4)
    _started(tmp_path, "singleton-seed2.json", "4cdd6a0c1e7b", ZEN4)
    _started(tmp_path, "broadcast-seed3.json", "66e56c080282", "GenuineIntel family 6 model 167")
    assert seed_starts(tmp_path, "pool", 2) == {"4cdd6a0c1e7b": [ZEN4]}
    here = Start("66e56c080282", "recipe", {})
    with pytest.raises(ValueError) as info:
        check_seed_start(tmp_path, "pool", 2, here)
    assert str(info.value) == (
        f"seed 2 of pool began from start 4cdd6a0c1e7b (made on {ZEN4}), and this machine's "
        "recipe makes 66e56c080282: a seed's cells must share one start, so finish seed 2 on a "
        "machine that rebuilds 4cdd6a0c1e7b, and run other seeds here (`casi experiment status` lists "
        "them)"
    )
    check_seed_start(tmp_path, "pool", 3, here)  # its own start: fine
    check_seed_start(tmp_path, "pool", 4, here)  # not begun: fine
    check_seed_start(tmp_path, "pool", 2, Start("4cdd6a0c1e7b", "recipe", {}))


def test_the_refusal_names_every_machine_that_made_the_start(tmp_path: Path) -> None:
    """Seed 2 began on Zen 4; seed 0's cells from the same start ran on Zen 5: both CPU families
    rebuilt 4cdd6a0c1e7b from the recipe, so either can finish seed 2."""
    _started(tmp_path, "broadcast-seed2.json", "4cdd6a0c1e7b", ZEN4)
    _started(tmp_path, "shapley-seed0.json", "4cdd6a0c1e7b", ZEN5)
    _started(tmp_path, "broadcast-seed3.json", "66e56c080282", "GenuineIntel family 6 model 167")
    assert seed_starts(tmp_path, "pool", 2) == {"4cdd6a0c1e7b": [ZEN4]}
    with pytest.raises(ValueError, match=re.escape(f"(made on {ZEN4}; {ZEN5})")):
        check_seed_start(tmp_path, "pool", 2, Start("66e56c080282", "recipe", {}))


@pytest.fixture
def seed2_begun_on_zen4(
    cli_var: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[str], Result]:
    """A results folder where seed 2's broadcast cell began from 4cdd6a0c1e7b on Zen 4, and a
    machine whose recipe makes 66e56c080282 (given here, instead of building a warm start);
    ``credit(mode)`` asks it for seed 2's cell of that mode."""
    import app.cli.experiment_cells as experiment_cli

    def this_machines_start(*_: object) -> tuple[None, Start]:
        return None, Start("66e56c080282", "recipe", {})

    monkeypatch.setattr(experiment_cli, "resolve_start", this_machines_start)
    out = tmp_path / "results"
    _started(out, "broadcast-seed2.json", "4cdd6a0c1e7b", ZEN4)

    def credit(mode: str) -> Result:
        return CliRunner().invoke(
            app,
            ["experiment", "credit", "--protocol", str(PROTOCOL), "--environment", "pool",
             "--out", str(out), "--seeds", "2", "--modes", mode],
        )  # fmt: skip

    return credit


def test_the_command_refuses_a_seed_begun_elsewhere_before_any_cell(
    cli_var: Path, seed2_begun_on_zen4: Callable[[str], Result]
) -> None:
    """Wired before the index is built or a cell trains."""
    done = seed2_begun_on_zen4("shapley")
    assert done.exit_code == 2, done.output
    text = " ".join(done.output.split())
    assert f"error: seed 2 of pool began from start 4cdd6a0c1e7b (made on {ZEN4})" in text
    assert "this machine's recipe makes 66e56c080282" in text
    # the protocol's own README, not another experiment's (compared without the line breaks)
    hint = f"— {PROTOCOL.parent / 'README.md'} describes the protocol and its cells"
    assert "".join(text.split()).endswith("".join(hint.split()))
    assert not (cli_var / "index").exists()  # nothing built


def test_a_seed_whose_asked_cells_are_all_done_is_not_refused(
    seed2_begun_on_zen4: Callable[[str], Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking again for seed 2's finished broadcast cell on another start is no conflict (the
    cell is kept): the command goes on to build the index, stopped here by a sentinel."""
    import app.cli.experiment_cells as experiment_cli

    class Reached(Exception):
        pass

    def no_index(*_: object, **__: object) -> None:
        raise Reached

    monkeypatch.setattr(experiment_cli, "build_retrieval", no_index)
    done = seed2_begun_on_zen4("broadcast")
    assert isinstance(done.exception, Reached), done.output


def test_the_start_is_chosen_for_the_seeds_asked(
    cli_var: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`resolve_start` is told the starts that the asked seeds with cells left began from, so a
    start imported for them (`casi policy import`) is the one their cells run from."""
    import app.cli.experiment_cells as experiment_cli

    asked: list[set[str]] = []

    def the_imported_start(_p: object, _s: object, _f: object, begun: set[str]) -> Any:
        asked.append(set(begun))
        return None, Start("4cdd6a0c1e7b", "recipe", {}, imported=True, made_on=ZEN4)

    class Reached(Exception):
        pass

    def no_index(*_: object, **__: object) -> None:
        raise Reached

    monkeypatch.setattr(experiment_cli, "resolve_start", the_imported_start)
    monkeypatch.setattr(experiment_cli, "build_retrieval", no_index)
    out = tmp_path / "results"
    _started(out, "broadcast-seed2.json", "4cdd6a0c1e7b", ZEN4)
    _started(out, "broadcast-seed3.json", "66e56c080282", "GenuineIntel family 6 model 167")
    for seeds, mode in (("2", "shapley"), ("2", "broadcast"), ("1,2", "shapley")):
        done = CliRunner().invoke(
            app,
            ["experiment", "credit", "--protocol", str(PROTOCOL), "--environment", "pool",
             "--out", str(out), "--seeds", seeds, "--modes", mode],
        )  # fmt: skip
        assert isinstance(done.exception, Reached), done.output  # seed 2 is not refused
    assert asked == [{"4cdd6a0c1e7b"}, set(), {"4cdd6a0c1e7b"}]  # broadcast-seed2 is done
    assert Start("v", "r", {}, imported=True, made_on=ZEN4).pin() == {
        "version": "v", "recipe": "r", "made_on": ZEN4,
    }  # fmt: skip
    assert Start("v", "r", {}).pin() == {"version": "v", "recipe": "r"}  # made here: as before
