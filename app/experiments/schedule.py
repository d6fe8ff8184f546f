"""When and where to run cells (`casi experiment credit --protocol … --stop-by`, `casi experiment
status`): how long a cell is expected to take on this CPU family, whether a seed was begun from
another start, and which planned cells are left and which machines can run them; all read off
the finished cell files of a results folder (`app.experiments.cell`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from app.experiments.protocol import Environment, Protocol
from app.experiments.protocol_keys import MAX_SEEDS, SEED_LIMIT
from app.experiments.result_file import cell_path
from app.experiments.results_folder import refusals
from app.experiments.start import Start

SEEDS_SYNTAX = (
    "seeds are a comma list of seeds and ranges: 0 (seed 0 alone), 0,2,5, 0-5 (seeds 0 to 5), "
    f"0-2,7; ASCII digits, at most {MAX_SEEDS} seeds, each below {SEED_LIMIT}"
)
SEED_ITEM = re.compile(r"(?P<low>[0-9]{1,10})(?:-(?P<high>[0-9]{1,10}))?")


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: ``0`` (seed 0 alone), ``0,2,5``, ``0-5`` (0 to 5 inclusive), mixed
    (``0-2,7``); one trailing comma is allowed (``5,``). ASCII digits only, distinct seeds, at
    most `MAX_SEEDS`, each below `SEED_LIMIT`; anything else is a ValueError stating the syntax."""

    def bad(reason: str) -> ValueError:
        shown = repr(text) if len(text) <= 40 else repr(text[:37]) + "..."
        return ValueError(f"--seeds {shown}: {reason}; {SEEDS_SYNTAX}")

    items = text.strip(" ").split(",")
    if len(items) > 1 and not items[-1].strip(" "):
        items.pop()  # "5,": seed 5
    seeds: list[int] = []
    for item in items:
        match = SEED_ITEM.fullmatch(item.strip(" "))
        if match is None:
            raise bad(
                f"{item.strip(' ')!r} is neither a seed nor a range"
                if item.strip(" ")
                else "an empty item"
            )
        low = int(match["low"])
        high = int(match["high"]) if match["high"] is not None else low
        if high >= SEED_LIMIT:
            raise bad(f"{high} is not below {SEED_LIMIT}")
        if high < low:
            raise bad(f"the range {low}-{high} runs backwards")
        if len(seeds) + high - low + 1 > MAX_SEEDS:
            raise bad(f"more than {MAX_SEEDS} seeds")
        seeds.extend(range(low, high + 1))
    if len(set(seeds)) != len(seeds):
        raise bad(f"seed {next(s for s in seeds if seeds.count(s) > 1)} is named twice")
    return seeds


def protocol_seeds(env: Environment, text: str | None) -> list[int]:
    """The seeds of ``env`` to run: ``--seeds`` (every one planned by the protocol), or all the
    planned ones (0..seeds-1) when it is not given."""
    if text is None:
        return list(range(env.seeds))
    seeds = parse_seeds(text)
    if outside := [s for s in seeds if s >= env.seeds]:
        raise ValueError(
            f"--seeds {text!r} names seed {outside[0]}, which the protocol does not plan: "
            f"environment {env.name} has seeds {env.planned()}"
        )
    return seeds


def parse_stop_by(text: str, now: datetime) -> datetime:
    """``--stop-by``: ``HH:MM`` (local time: today, or tomorrow when it is already past) or an
    ISO date-time (``2026-12-05T08:50``); a naive time is local. ValueError stating the syntax."""
    value = text.strip()
    clock = re.fullmatch(r"([0-9]{1,2}):([0-9]{2})", value)
    if clock is not None:
        hour, minute = int(clock[1]), int(clock[2])
        if hour > 23 or minute > 59:
            raise ValueError(f"--stop-by {text!r}: no such time of day (HH:MM, 00:00 to 23:59)")
        at = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
        return at if at > now else at + timedelta(days=1)
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"--stop-by {text!r}: give HH:MM (local time) or an ISO date-time "
            "such as 2026-12-05T08:50"
        ) from None
    if at.tzinfo is not None:
        at = at.astimezone().replace(tzinfo=None)
    if at <= now:
        raise ValueError(f"--stop-by {text!r} is already past (now {now:%Y-%m-%d %H:%M})")
    return at


def fits_before(
    stop_by: datetime | None, estimate: CellEstimate, now: datetime, cells: int = 1
) -> bool:
    """Whether ``cells`` cells, each expected to take ``estimate``, end by ``stop_by`` (always,
    with no stop time or nothing to estimate from: the first cell of a folder is how one
    learns)."""
    if stop_by is None or estimate.seconds is None:
        return True
    return now + timedelta(seconds=estimate.seconds * cells) <= stop_by


CELL_TIME_MARGIN = 1.25
"""`cell_estimate` is this times the longest finished cell: cells of one machine differ in wall
time by up to a quarter (the policy's rewrites, and so its retrievals, change as it learns)."""


@dataclass(frozen=True)
class CellEstimate:
    """How long a cell of this environment is expected to take here (None: no cell to go by)."""

    seconds: float | None
    basis: str  # what it was taken from, for the message that quotes it


def _finished_cells(out: Path, environment: str) -> Iterator[tuple[Path, Any]]:
    """The cell files of ``<out>/<environment>/`` with their parsed content, skipping the
    unreadable ones (the aggregate, not the scheduling helpers, refuses a bad file)."""
    for path in sorted((Path(out) / environment).glob("*-seed*.json")):
        try:
            yield path, json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            continue


def cell_estimate(out: Path, environment: str, cpu_family: str | None) -> CellEstimate:
    """`CELL_TIME_MARGIN` × the longest wall time among the finished cells in
    ``<out>/<environment>/`` that ran wholly on ``cpu_family`` (`machine_info`'s); of any
    machine when none did (the basis says so). Unreadable files count as no cell: the aggregate,
    not this estimate, is where a bad file is refused."""
    walls: dict[bool, list[float]] = {True: [], False: []}
    for _path, data in _finished_cells(out, environment):
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


SEED_FILE = re.compile(r"-seed([0-9]+)\.json$")
"""A cell file's name ends with its seed: ``shapley-seed2.json``."""


def _starts_by_seed(out: Path, environment: str) -> dict[int, dict[str, set[str]]]:
    """Seed → start version → the CPU families (`machine_info`'s) that made the start of the
    seed's finished cells of ``<out>/<environment>/``: the machines that ran them (each rebuilt
    the start from the recipe) or, for a cell from an imported start, the family it records as
    the start's maker; in one pass over the files. Unreadable files are left to the aggregate,
    which refuses them."""
    found: dict[int, dict[str, set[str]]] = {}
    for path, data in _finished_cells(out, environment):
        match = SEED_FILE.search(path.name)
        try:
            version = str(data["start"]["version"])
            if "made_on" in data["start"]:  # an imported start: who made it, not who ran it
                made_on = data["start"]["made_on"]
                families = {str(made_on)} if made_on is not None else set()
            else:
                families = {str(m.get("cpu_family")) for m in data["compute"]["machines"]}
        except (KeyError, TypeError, AttributeError):
            continue
        if match is not None:
            found.setdefault(int(match[1]), {}).setdefault(version, set()).update(families)
    return found


def _listed(starts: dict[str, set[str]]) -> dict[str, list[str]]:
    return {v: sorted(f) for v, f in sorted(starts.items())}


def _every_start(by_seed: dict[int, dict[str, set[str]]]) -> dict[str, list[str]]:
    """Start version → the CPU families that ran cells of any seed from it."""
    merged: dict[str, set[str]] = {}
    for starts in by_seed.values():
        for version, families in starts.items():
            merged.setdefault(version, set()).update(families)
    return _listed(merged)


def seed_starts(out: Path, environment: str, seed: int) -> dict[str, list[str]]:
    """The starts the finished cells of ``seed`` in ``<out>/<environment>/`` began from: start
    version → the CPU families that ran those cells."""
    return _listed(_starts_by_seed(out, environment).get(seed, {}))


def check_seed_start(out: Path, environment: str, seed: int, start: Start) -> None:
    """ValueError when finished cells of ``seed`` began from another start than ``start``: the
    aggregate refuses a seed whose cells name two starts, so such a cell would be trained for
    nothing. The message names the machines that can finish the seed: every CPU family that ran
    a cell of the environment, of any seed, from that start."""
    by_seed = _starts_by_seed(out, environment)
    other = [v for v in _listed(by_seed.get(seed, {})) if v != start.version]
    if other:
        version = other[0]
        families = _every_start(by_seed)[version]
        raise ValueError(
            f"seed {seed} of {environment} began from start {version} (made on "
            f"{'; '.join(families)}), and this machine's recipe makes {start.version}: a seed's "
            f"cells must share one start, so finish seed {seed} on a machine that rebuilds "
            f"{version}, and run other seeds here (`casi experiment status` lists them)"
        )


def cells_to_fit(out: Path, environment: str, cells: list[tuple[str, int]], index: int) -> int:
    """How many cells must fit before ``--stop-by`` for ``cells[index]`` (mode, seed) to start:
    0 when its file is in (nothing runs); for the first cell of a seed with no finished cell,
    every asked cell of that seed still to run (a seed is begun only whole: its cells share
    one start, which another CPU's recipe may not make, so a seed left half done can wait
    for one CPU family); else 1."""
    mode, seed = cells[index]
    if cell_path(out, environment, mode, seed).is_file():
        return 0
    if seed_starts(out, environment, seed):
        return 1  # begun: cell by cell
    return sum(
        1 for m, s in cells[index:] if s == seed and not cell_path(out, environment, m, s).is_file()
    )


def plan_cell(
    out: Path,
    environment: str,
    cells: list[tuple[str, int]],
    index: int,
    put_off: Collection[int],
    fits: Callable[[int], bool],
) -> tuple[str, int]:
    """What a `--stop-by` run does at ``cells[index]``, given which seeds it has put off and
    whether ``n`` more cells would end in time (``fits(n)``): ``("run", n)`` (``n`` = 0: its
    file is in, kept), ``("skip", 0)`` (its seed was put off), ``("put_off", n)`` (a seed not
    begun whose ``n`` asked cells would not all end in time: none of them runs, a later seed
    already begun still may) or ``("stop", 1)`` (the cell alone would not end in time)."""
    if cells[index][1] in put_off:
        return "skip", 0
    need = cells_to_fit(out, environment, cells, index)
    if need == 0 or fits(need):
        return "run", need
    return ("put_off" if need > 1 else "stop"), need


def half_done_seeds(out: Path, env: Environment, seeds: list[int], version: str) -> list[int]:
    """The ``seeds`` begun from start ``version`` in ``<out>/<env>/`` with planned cells left:
    what a machine holding that start should pass on (`casi policy export`) before it goes."""
    by_seed = _starts_by_seed(out, env.name)
    return [
        seed
        for seed in seeds
        if version in by_seed.get(seed, {})
        and any(not cell_path(out, env.name, m, seed).is_file() for m in env.modes)
    ]


@dataclass(frozen=True)
class SeedStatus:
    """One planned seed of one environment: its cells done and left, the start its finished
    cells began from and the CPU families that ran cells from that start, and whether this
    machine can run the cells left (``here``: ``done``, ``yes``, ``no``, ``unknown`` or
    ``broken``; ``reason`` says why)."""

    environment: str
    seed: int
    done: tuple[str, ...]
    missing: tuple[str, ...]
    start: str | None  # None: no cell of this seed yet (any machine may begin it)
    made_on: tuple[str, ...]
    here: str
    reason: str


def _here(
    starts: dict[str, list[str]],
    by_start: dict[str, list[str]],
    cpu_family: str | None,
    local: Collection[str],
) -> tuple[str, str]:
    """Whether a machine of ``cpu_family`` holding the starts ``local`` can run the cells left of
    a seed whose finished cells began from ``starts`` (version → families), given every start of
    the environment (``by_start``): the recipe makes the same start only on one
    microarchitecture, and a start imported from another machine serves as well."""
    if not starts:
        return "yes", "no cell yet: the seed begins from the start this machine makes"
    if len(starts) > 1:
        return (
            "broken",
            f"its cells name {len(starts)} starts ({', '.join(starts)}); the aggregate refuses it",
        )
    version = next(iter(starts))
    if cpu_family is not None and cpu_family in by_start.get(version, []):
        return "yes", f"this CPU family made start {version}"
    if version in local:
        return "yes", f"start {version} is on this machine (var/models/recipes)"
    mine = [v for v, families in by_start.items() if cpu_family in families]
    if mine:
        return (
            "no",
            f"this CPU family makes start {mine[0]}, not {version} (`casi policy import` it "
            "from a machine that has it)",
        )
    return (
        "unknown",
        f"no cell from this CPU family yet: build the start and compare it with {version}",
    )


def protocol_status(
    out: Path,
    protocol: Protocol,
    cpu_family: str | None,
    local: Collection[str] = (),
    refused: list[tuple[str, str]] | None = None,
) -> list[SeedStatus]:
    """Every planned seed of every environment of ``protocol`` in the results folder ``out``:
    what is done, what is left and whether a machine of ``cpu_family`` holding the starts
    ``local`` (`app.training.warmstart.local_start_versions`) can run it. A seed with a cell
    file the aggregate refuses (``refused``, default
    `app.experiments.results_folder.refusals`: the aggregate's own checks) is ``broken``, the
    file named, never ``done``."""
    bad = {label for label, _ in (refusals(out, protocol) if refused is None else refused)}
    rows = []
    for env in protocol.environments.values():
        by_seed = _starts_by_seed(out, env.name)
        by_start = _every_start(by_seed)
        for seed in range(env.seeds):
            paths = {m: cell_path(out, env.name, m, seed) for m in env.modes}
            done = tuple(m for m in env.modes if paths[m].is_file())
            missing = tuple(m for m in env.modes if m not in done)
            starts = _listed(by_seed.get(seed, {}))
            start = next(iter(starts)) if len(starts) == 1 else None
            here, reason = _here(starts, by_start, cpu_family, local)
            if not missing and here != "broken":
                here, reason = "done", "every planned cell is in"
            if named := [
                f"{env.name}/{paths[m].name}" for m in done if f"{env.name}/{paths[m].name}" in bad
            ]:
                here, reason = "broken", f"the aggregate refuses {', '.join(named)}"
            made_on = tuple(by_start.get(start, [])) if start is not None else ()
            rows.append(SeedStatus(env.name, seed, done, missing, start, made_on, here, reason))
    return rows


def runnable(env: Environment, rows: list[SeedStatus]) -> list[tuple[str, str]]:
    """What a machine can run of ``env`` (its status ``rows``): per set of modes left, the seeds
    this machine can finish (``here`` = yes) as ``--seeds`` text, and ``--modes …`` (empty when
    every mode is left), in the rows' order."""
    seeds: dict[tuple[str, ...], list[int]] = {}  # the modes left → the seeds
    for r in rows:
        if r.missing and r.here == "yes":
            seeds.setdefault(r.missing, []).append(r.seed)
    return [
        (",".join(map(str, s)), "" if missing == env.modes else f" --modes {' '.join(missing)}")
        for missing, s in seeds.items()
    ]
