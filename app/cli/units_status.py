"""`casi experiment status PROTOCOL`: which planned cells of a protocol are in, which are left,
and which of them this machine can run (reads files only; trains and downloads nothing).

A protocol's cells land one at a time, on whatever machines run them, and a seed's cells must
share one start, which the warm-start recipe makes bit for bit only on one microarchitecture.
So before starting cells a session asks: what is left, and is this CPU family one that made the
start of that seed?
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import fail
from app.cli.units import fail_with_guide, warmstart_command
from app.progress import console
from app.settings import get_settings
from app.training.evaluate import machine_info, short_family
from app.training.units_protocol import load_protocol
from app.training.units_schedule import SeedStatus, cell_estimate, protocol_status
from app.training.warmstart import local_start_versions

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
    which are left, and whether this machine can run them: a seed's cells must share one start,
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
    rows = protocol_status(folder, protocol, family, local)
    total = sum(len(r.done) + len(r.missing) for r in rows)
    done = sum(len(r.done) for r in rows)
    console.print(
        f"protocol [bold]{protocol.name}[/] ({protocol.hash}), results in {folder}: "
        f"{done} of {total} planned cells in"
    )
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
        runnable: dict[tuple[str, ...], list[int]] = {}  # the modes left → the seeds
        for r in env_rows:
            if r.missing and r.here == "yes":
                runnable.setdefault(r.missing, []).append(r.seed)
        for missing, seeds in runnable.items():
            modes = "" if missing == env.modes else f" --modes {' '.join(missing)}"
            commands.append(
                f"casi experiment credit --protocol {protocol_file}{opt_out} --environment "
                f"{name} --seeds {','.join(map(str, seeds))}{modes}"
            )
    if commands:
        console.print("run here (each resumable; add --stop-by HH:MM to stop in time):")
        for command in commands:
            console.print(f"  {command}", markup=False, highlight=False, soft_wrap=True)
    if any(r.missing and r.here == "unknown" for r in rows):
        console.print(
            "to learn whether this machine can finish the 'unknown' seeds, build the start and "
            f"compare its version: {warmstart_command(protocol.start, protocol.dataset)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    if not commands and done < total:
        console.print("nothing left that this machine is known to be able to run")
