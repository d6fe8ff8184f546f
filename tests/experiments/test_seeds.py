"""Issue 38, items 5 and 8: `--seeds` of `casi experiment credit`.

The syntax cannot be misread: a comma list of seeds and ranges of ASCII digits (``0`` is seed 0
alone, ``3`` is seed 3 — not three seeds; ``0-5`` is 0 to 5), at most `MAX_SEEDS` seeds, each
below 2^31. Before, ``0`` was refused with a confusing message, ``0,,1`` passed, the full-width
``２`` read as 2, ``1000000000`` built a 36 GB list and ``99999999999999999999999`` raised
OverflowError. With ``--protocol`` the default is the environment's planned seeds (it was 5
whatever the protocol said) and a seed the protocol does not plan is refused (``7,`` was
accepted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import app.cli.experiment as experiment_cli
from app.cli import app
from app.experiments.protocol import load_protocol
from app.experiments.protocol_keys import MAX_SEEDS, SEED_LIMIT
from app.experiments.schedule import SEEDS_SYNTAX, parse_seeds, protocol_seeds

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "docs" / "experiments" / "credit-units" / "protocol.toml"


@pytest.mark.parametrize(
    ("text", "seeds"),
    [
        ("0", [0]),
        ("3", [3]),  # seed 3 alone, not three seeds
        ("0,1,2", [0, 1, 2]),
        ("2,0", [2, 0]),  # run in the order given
        ("0-5", [0, 1, 2, 3, 4, 5]),
        ("0-2,7", [0, 1, 2, 7]),
        ("4-4", [4]),
        ("5,", [5]),  # the spelling of one seed in earlier command lines
        (" 1, 3 ", [1, 3]),
        ("1000000000", [1_000_000_000]),  # one seed, not a list of 10^9
        (f"0-{MAX_SEEDS - 1}", list(range(MAX_SEEDS))),
        (str(SEED_LIMIT - 1), [SEED_LIMIT - 1]),
    ],
)
def test_seeds_syntax(text: str, seeds: list[int]) -> None:
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "an empty item"),
        (",", "an empty item"),
        ("0,,1", "an empty item"),
        (",1", "an empty item"),
        ("0,1,,", "an empty item"),
        ("２", "'２' is neither a seed nor a range"),  # full-width digit two
        ("٣", "'٣' is neither a seed nor a range"),  # Arabic-Indic three
        ("-2", "'-2' is neither a seed nor a range"),
        ("1e3", "'1e3' is neither a seed nor a range"),
        ("0x1", "'0x1' is neither a seed nor a range"),
        ("a", "'a' is neither a seed nor a range"),
        ("1 2", "'1 2' is neither a seed nor a range"),
        ("99999999999999999999999", "'99999999999999999999999' is neither a seed nor a range"),
        (str(SEED_LIMIT), f"{SEED_LIMIT} is not below {SEED_LIMIT}"),
        ("3-1", "the range 3-1 runs backwards"),
        ("1,1", "seed 1 is named twice"),
        ("0-2,1", "seed 1 is named twice"),
        (f"0-{MAX_SEEDS}", f"more than {MAX_SEEDS} seeds"),
        ("0-2000000000", f"more than {MAX_SEEDS} seeds"),  # refused without building a list
    ],
)
def test_bad_seeds_are_one_line_saying_the_syntax(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_seeds(text)
    assert str(info.value) == f"--seeds {text!r}: {reason}; {SEEDS_SYNTAX}"
    assert "\n" not in str(info.value)


def test_the_syntax_states_the_limits() -> None:
    assert SEEDS_SYNTAX == (
        "seeds are a comma list of seeds and ranges: 0 (seed 0 alone), 0,2,5, 0-5 (seeds 0 to "
        "5), 0-2,7; ASCII digits, at most 1000 seeds, each below 2147483648"
    )


def test_a_protocol_runs_its_planned_seeds_and_no_others() -> None:
    protocol = load_protocol(PROTOCOL)
    main, control = protocol.environment("main"), protocol.environment("control")
    assert protocol_seeds(main, None) == [0, 1, 2, 3, 4, 5]
    assert protocol_seeds(control, None) == [0, 1, 2]
    assert protocol_seeds(main, "5,") == [5] and protocol_seeds(control, "0-2") == [0, 1, 2]
    with pytest.raises(ValueError) as info:
        protocol_seeds(main, "7,")
    assert str(info.value) == (
        "--seeds '7,' names seed 7, which the protocol does not plan: environment main has "
        "seeds 0-5"
    )


def _one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) >= 1 and lines[0].startswith("error: "), output
    return " ".join(output.split())


def test_the_command_refuses_a_seed_the_protocol_does_not_plan(cli_var: Path) -> None:
    done = CliRunner().invoke(
        app,
        ["experiment", "credit", "--protocol", str(PROTOCOL), "--environment", "main", "--seeds", "7,"],
    )  # fmt: skip
    assert done.exit_code == 2, done.output
    line = _one_error_line(done.output)
    assert line.startswith(
        "error: --seeds '7,' names seed 7, which the protocol does not plan: environment main "
        "has seeds 0-5"
    )
    assert not (cli_var / "casi.db").exists()  # refused before anything was opened


def test_the_command_refuses_unicode_digits(cli_var: Path) -> None:
    done = CliRunner().invoke(app, ["experiment", "credit", "--seeds", "２"])
    assert done.exit_code == 2, done.output
    line = _one_error_line(done.output)
    assert line.startswith("error: --seeds '２': '２' is neither a seed nor a range; seeds are")
    assert not (cli_var / "casi.db").exists()


def test_without_seeds_a_protocol_gets_its_planned_seeds(
    cli_var: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: dict[str, Any] = {}

    def record(*args: Any, **kwargs: Any) -> None:
        asked["seeds_text"] = args[4]

    monkeypatch.setattr(experiment_cli, "run_protocol_cells", record)
    done = CliRunner().invoke(
        app, ["experiment", "credit", "--protocol", str(PROTOCOL), "--environment", "main"]
    )
    assert done.exit_code == 0, done.output
    assert asked == {"seeds_text": None}  # → protocol_seeds(env, None): the planned seeds
