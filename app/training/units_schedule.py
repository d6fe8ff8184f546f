"""When to run cells (`casi experiment credit --protocol … --stop-by`): how long a cell is
expected to take on this CPU family, and whether a seed was begun from another start; both read
off the finished cell files of a results folder (`app.training.units`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.training.units import Start

CELL_TIME_MARGIN = 1.25
"""`cell_estimate` is this times the longest finished cell: cells of one machine differ in wall
time by up to a quarter (the policy's rewrites, and so its retrievals, change as it learns)."""


@dataclass(frozen=True)
class CellEstimate:
    """How long a cell of this environment is expected to take here (None: no cell to go by)."""

    seconds: float | None
    basis: str  # what it was taken from, for the message that quotes it


def _finished_cells(out: Path, environment: str, pattern: str) -> Iterator[Any]:
    """The parsed cell files of ``<out>/<environment>/`` whose names match ``pattern``, skipping
    the unreadable ones (the aggregate, not the scheduling helpers, refuses a bad file)."""
    for path in sorted((Path(out) / environment).glob(pattern)):
        try:
            yield json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            continue


def cell_estimate(out: Path, environment: str, cpu_family: str | None) -> CellEstimate:
    """`CELL_TIME_MARGIN` × the longest wall time among the finished cells in
    ``<out>/<environment>/`` that ran wholly on ``cpu_family`` (`machine_info`'s); of any
    machine when none did (the basis says so). Unreadable files count as no cell: the aggregate,
    not this estimate, is where a bad file is refused."""
    walls: dict[bool, list[float]] = {True: [], False: []}
    for data in _finished_cells(out, environment, "*-seed*.json"):
        try:
            compute = data["compute"]
            wall = float(compute["wall_s"])
            families = {m.get("cpu_family") for m in compute["machines"]}
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if math.isfinite(wall) and wall > 0:
            walls[cpu_family is not None and families == {cpu_family}].append(wall)
    for same, label in (
        (True, "this CPU family"),
        (False, "other machines (none of this CPU family)"),
    ):
        if walls[same]:
            longest = max(walls[same])
            return CellEstimate(
                CELL_TIME_MARGIN * longest,
                f"{CELL_TIME_MARGIN} × the longest of {len(walls[same])} finished cells on "
                f"{label}, {longest / 60:.1f} min",
            )
    return CellEstimate(None, "no finished cell to estimate from")


def _start_machines(out: Path, environment: str, pattern: str) -> dict[str, list[str]]:
    """Start version → the CPU families (`machine_info`'s) that ran the finished cells of
    ``<out>/<environment>/`` named ``pattern`` from it: each of them rebuilt that start from the
    recipe. Unreadable files are left to the aggregate, which refuses them."""
    starts: dict[str, set[str]] = {}
    for data in _finished_cells(out, environment, pattern):
        try:
            version = str(data["start"]["version"])
            families = {str(m.get("cpu_family")) for m in data["compute"]["machines"]}
        except (KeyError, TypeError, AttributeError):
            continue
        starts.setdefault(version, set()).update(families)
    return {v: sorted(f) for v, f in sorted(starts.items())}


def seed_starts(out: Path, environment: str, seed: int) -> dict[str, list[str]]:
    """The starts the finished cells of ``seed`` in ``<out>/<environment>/`` began from: start
    version → the CPU families that ran those cells."""
    return _start_machines(out, environment, f"*-seed{seed}.json")


def check_seed_start(out: Path, environment: str, seed: int, start: Start) -> None:
    """ValueError when finished cells of ``seed`` began from another start than ``start``: the
    aggregate refuses a seed whose cells name two starts, so such a cell would be trained for
    nothing. The message names the machines that can finish the seed: every CPU family that ran
    a cell of the environment, of any seed, from that start."""
    other = [v for v in seed_starts(out, environment, seed) if v != start.version]
    if other:
        version = other[0]
        families = _start_machines(out, environment, "*-seed*.json")[version]
        raise ValueError(
            f"seed {seed} of {environment} began from start {version} (made on "
            f"{'; '.join(families)}), and this machine's recipe makes {start.version}: a seed's "
            f"cells must share one start, so finish seed {seed} on a machine that rebuilds "
            f"{version}, and run other seeds here"
        )
