"""`casi experiment …`: the pre-registered credit experiment, run cell by cell.

- ``credit --protocol P --environment E``: run the asked cells of one environment, one after
  another (resumable; ``--stop-by`` starts a cell only if it should end in time). Read
  `app.cli.experiment_cells.run_protocol_cells`: settings with the environment's game →
  database → the pinned start (`app.experiments.start`) → retrieval, scorer, the held-out
  request → per cell the schedule's decision (`app.experiments.schedule`), then the cell
  (`app.experiments.cell`).
- ``status P``: which planned cells are in, which the aggregate refuses, which are left and
  whether this machine can run them (files only).
- ``aggregate FOLDER``: every committed cell turned into ``table.md`` and ``ndcg.png``
  (`app.experiments.aggregate`; files only).

The plan-mode ``credit`` (no ``--protocol``) is retired: its one committed result,
docs/experiments/credit/, is a frozen artifact (docs/experiments.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from app.cli.common import fail
from app.cli.experiment_cells import GUIDE, fail_with_guide, run_protocol_cells
from app.cli.options import given_options, with_config_options
from app.experiments.aggregate import aggregate
from app.experiments.cell import cell_settings
from app.experiments.protocol import load_protocol
from app.experiments.results_folder import refusals
from app.experiments.schedule import (
    SeedStatus,
    cell_estimate,
    parse_seeds,
    protocol_status,
    runnable,
)
from app.experiments.start import warmstart_command
from app.progress import console
from app.settings import get_settings
from app.training.evaluate import machine_info, short_family
from app.training.warmstart import local_start_versions
from policy.train_config import TrainConfig

experiment_app = typer.Typer(
    help="The pre-registered credit experiment: its cells, their status and their aggregate.",
    no_args_is_help=True,
)
Opt = typer.Option
RETIRED = (
    "`casi experiment credit` without --protocol is retired — run the cells of a pre-registered "
    "protocol: `casi experiment credit --protocol PROTOCOL.toml --environment ENV` ({guide})"
)


@experiment_app.command("credit")
@with_config_options(TrainConfig.options())
def credit_experiment(
    modes: Annotated[
        list[str] | None, Opt("--modes", help="Credit modes (repeat or space-separate).")
    ] = None,
    extra: Annotated[
        list[str] | None, typer.Argument(help="More modes after --modes", show_default=False)
    ] = None,
    seeds: Annotated[
        str | None,
        Opt(
            help="Seeds: a comma list of seeds and ranges of ASCII digits: 0 (seed 0 alone; "
            "3 is seed 3, not three seeds), 0,2,5, 0-4 (seeds 0 to 4), 0-2,7; at most 1000 "
            "seeds, each below 2^31. Default: the environment's planned seeds, and only those "
            "are accepted.",
            show_default=False,
        ),
    ] = None,
    protocol: Annotated[
        Path | None,
        Opt(
            help="A pre-registered protocol (TOML): run its cells (--environment, --modes, --seeds); "
            "the protocol fixes every training setting."
        ),
    ] = None,
    environment: Annotated[
        str | None, Opt(help="The protocol's environment whose cells to run.")
    ] = None,
    out: Annotated[
        Path | None, Opt(help="The results folder (default: the protocol file's folder).")
    ] = None,
    stop_by: Annotated[
        str | None,
        Opt(
            "--stop-by",
            help="Start a cell only if it should end by this local time "
            "(HH:MM, today or, if past, tomorrow; or an ISO date-time): 1.25 × the longest "
            "finished cell of this CPU family (of any machine, when this family has none). A "
            "seed with no finished cell is begun only if all its asked cells should end by "
            "then: its cells share one start, which another CPU's recipe may not make.",
            show_default=False,
        ),
    ] = None,
    **given: Any,
) -> None:
    """Run the cells of a pre-registered protocol: per environment × credit mode × seed, train
    from the protocol's pinned start and evaluate on its held-out claims, one small result file
    per cell (resumable; docs/experiments.md)."""
    if protocol is None:
        if seeds is not None:  # a malformed value is named first, as for every option
            try:
                parse_seeds(seeds)
            except ValueError as exc:
                fail(f"{exc} — `casi experiment credit --help`")
        fail(RETIRED.format(guide=GUIDE))
    asked = list(modes or []) + list(extra or [])
    run_protocol_cells(
        get_settings(), protocol, environment, asked, seeds, out, given_options(given),
        stop_by=stop_by,
    )  # fmt: skip


@experiment_app.command("aggregate")
def aggregate_cmd(folder: Path) -> None:
    """Pair every committed cell of the protocol in FOLDER by seed and claim: table.md (means ±
    sd over seeds, per-seed values, every pre-registered comparison with CI, p and Holm p) and
    ndcg.png. Reads files only; the same files give the same bytes. Every file is checked first
    (its values, its name, its seed, its start) and nothing is written unless all pass."""
    try:
        result = aggregate(folder)
    except (ValueError, FileNotFoundError) as exc:
        fail_with_guide(exc, folder)
    console.print((Path(folder) / "table.md").read_text(), markup=False)
    n = sum(e["cells"] for e in result["environments"].values())
    console.print(f"{n} cells → {Path(folder) / 'table.md'}, {Path(folder) / 'ndcg.png'}")


# ---------------------------------------------------------------------------- status

MARK = {"done": "[green]done[/]", "yes": "[green]yes[/]", "no": "[red]no[/]",
        "unknown": "[yellow]unknown[/]", "broken": "[red]broken[/]"}  # fmt: skip


def _table(rows: list[SeedStatus]) -> Table:
    table = Table(show_lines=False)
    for column in ("seed", "cells in", "left", "start", "start made on", "here", "why"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(
            str(r.seed), str(len(r.done)), ", ".join(r.missing) or "—", r.start or "—",
            "; ".join(short_family(f) for f in r.made_on) or "—", MARK.get(r.here, r.here), "" if r.here == "done" else r.reason,
        )  # fmt: skip
    return table


@experiment_app.command("status")
def status_cmd(
    protocol_file: Annotated[
        Path, typer.Argument(metavar="PROTOCOL_FILE", help="A pre-registered protocol (TOML).")
    ],
    out: Annotated[
        Path | None,
        typer.Option(help="The results folder (default: the protocol file's folder)."),
    ] = None,
) -> None:
    """Which planned cells of the protocol in PROTOCOL_FILE are in (in its folder, or --out),
    which files the aggregate would refuse (each named), which are left, and whether this
    machine can run them: a seed's cells must share one start,
    and the recipe makes a start bit for bit only on one CPU microarchitecture (or the start is
    imported: `casi policy import`). Prints the commands that run what this machine can. Reads
    files only."""
    folder = Path(out) if out is not None else Path(protocol_file).parent
    try:
        protocol = load_protocol(Path(protocol_file))
    except (ValueError, FileNotFoundError, OSError) as exc:
        fail_with_guide(exc, Path(protocol_file).parent)
    if out is not None and not folder.is_dir():
        fail(
            f"--out {out}: no such results folder — check the path (a folder that is not there "
            "yet holds no cells; `casi experiment credit --out` makes it)"
        )
    family = machine_info()["cpu_family"]
    local = local_start_versions(get_settings().var_dir)  # made here or imported
    refused = refusals(folder, protocol)  # the aggregate's own checks, every file named
    rows = protocol_status(folder, protocol, family, local, refused)
    total = sum(len(r.done) + len(r.missing) for r in rows)
    done = sum(len(r.done) for r in rows)
    console.print(
        f"protocol [bold]{protocol.name}[/] ({protocol.hash}), results in {folder}: "
        f"{done} of {total} planned cells in"
        + (f"; the aggregate refuses {len(refused)} of its files" if refused else "")
    )
    if refused:
        console.print("refused by `casi experiment aggregate` (fix or move each):")
        for _, why in refused:
            console.print(f"  {why}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"this machine: {family or 'CPU family unknown (no /proc/cpuinfo)'}")
    if local:
        console.print(f"warm starts on this machine (made or imported): {', '.join(sorted(local))}")
    opt_out = f" --out {out}" if out is not None else ""
    commands: list[str] = []
    for env in protocol.environments.values():
        name = env.name
        env_rows = [r for r in rows if r.environment == name]
        estimate = cell_estimate(folder, name, family)
        took = (
            f"a cell here takes about {estimate.seconds / 60:.0f} min ({estimate.basis})"
            if estimate.seconds is not None
            else estimate.basis
        )
        left = sum(len(r.missing) for r in env_rows)
        console.rule(f"{name}: {left} cell{'s' * (left != 1)} left; {took}")
        console.print(_table(env_rows))
        for seeds, modes in runnable(env, env_rows):
            commands.append(
                f"casi experiment credit --protocol {protocol_file}{opt_out} --environment "
                f"{name} --seeds {seeds}{modes}"
            )
    if commands:
        console.print("run here (each resumable; add --stop-by HH:MM to stop in time):")
        for command in commands:
            console.print(f"  {command}", markup=False, highlight=False, soft_wrap=True)
    if unknown := [r for r in rows if r.missing and r.here == "unknown"]:
        env_settings = cell_settings(  # the teacher's start reads its environment's game
            get_settings(), protocol, protocol.environment(unknown[0].environment)
        )
        command = warmstart_command(protocol.start, protocol.dataset, env_settings)
        console.print(
            "to learn whether this machine can finish the 'unknown' seeds, build the start and "
            f"compare its version: {command}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    if not commands and done < total:
        console.print("nothing left that this machine is known to be able to run")
