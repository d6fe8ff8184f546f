"""A protocol's results folder, read and checked: :func:`load_env` (read it first) returns one
environment's cells and start evaluations, or a ValueError naming the file that is wrong.

Every file of ``<folder>/<environment>/`` is checked before any value is used: its values
(`app.experiments.result_file`, through `app.experiments.cell.read_result`); its name, which must
be exactly the one `app.experiments.cell` gives what it holds (``<mode>-seed<K>.json``,
``start-<version>.json``); no two files may hold one cell or one start (both are named); its
protocol hash, environment and claims (those of the other files); its mode and seed (ones the
protocol plans); its training config (the one the protocol gives that mode and seed); its
pins (one game, index and depth for the whole environment); its trained weights (no two
seeds' cells end in the same policy); its start (its evaluation present, one start per seed). Hidden files
(a writer's lock or temporary file) are passed over; anything else is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.experiments.protocol import Environment, Protocol
from app.experiments.result_file import CELL_FORMAT, cell_path, read_result, start_path
from policy.train_config import TrainConfig

Key = tuple[Any, ...]  # ("cell", mode, seed) or ("start", version)
RESULT_NAME = re.compile(r"(-seed[0-9]+|^start-[0-9a-f]+)\.json$")
"""The name of a cell or start file."""


@dataclass
class EnvCells:
    """One environment's checked results."""

    env: Environment
    cells: dict[tuple[str, int], dict[str, Any]]  # (mode, seed) → cell file
    starts: dict[str, dict[str, Any]]  # start version → start file
    claims: list[str] | None
    names: dict[tuple[str, int], str]  # (mode, seed) → its file's label


def _what(key: Key) -> str:
    return f"cell {key[1]}-seed{key[2]}" if key[0] == "cell" else f"start {key[1]}"


def _file_name(key: Key) -> str:
    """The one name of the file holding ``key`` (as `app.experiments.cell` writes it)."""
    if key[0] == "cell":
        return cell_path(Path(), "", key[1], key[2]).name
    return start_path(Path(), "", key[1]).name


def _entries(env_dir: Path) -> list[Path]:
    """What an environment's folder holds, less hidden files (a writer's lock or temporary file)."""
    return [path for path in sorted(env_dir.iterdir()) if not path.name.startswith(".")]


def _read_one(path: Path, env: Environment) -> tuple[str, Key, dict[str, Any]]:
    """One entry of an environment's folder, read and its values checked: (label, what it
    holds, data); ValueError naming it when it is not a result file."""
    label = f"{env.name}/{path.name}"
    if not path.is_file() or path.suffix != ".json":
        raise ValueError(
            f"{label}: not a result file; an environment's folder holds only <mode>-seed<K>.json "
            "and start-<version>.json files (move it elsewhere)"
        )
    data = read_result(path, label)
    if data["format"] == CELL_FORMAT:
        return label, ("cell", data["mode"], data["seed"]), data
    return label, ("start", data["start"]["version"]), data


def _check_name(label: str, key: Key, env: Environment) -> None:
    if label != f"{env.name}/{_file_name(key)}":
        raise ValueError(f"{label}: holds {_what(key)}, so its name must be {_file_name(key)}")


def _read_folder(env_dir: Path, env: Environment) -> list[tuple[str, Key, dict[str, Any]]]:
    """Every result file of an environment's folder, checked: (label, what it holds, data). A
    file named other than what it holds, and two files holding one cell or start, are refused."""
    files = [_read_one(path, env) for path in _entries(env_dir)]
    holders: dict[Key, list[str]] = {}
    for label, key, _ in files:
        holders.setdefault(key, []).append(label)
    for key, labels in holders.items():
        if len(labels) > 1:
            raise ValueError(
                f"{' and '.join(labels)} hold the same {_what(key)}: keep only "
                f"{env.name}/{_file_name(key)}"
            )
    for label, key, _ in files:
        _check_name(label, key, env)
    return files


def _env_dir(folder: Path, env: Environment) -> Path | None:
    """``<folder>/<environment>/`` (None: no results yet); ValueError when it is not a folder."""
    env_dir = folder / env.name
    if env_dir.exists() and not env_dir.is_dir():
        raise ValueError(
            f"{env.name}: not a folder; environment {env.name}'s results are the files "
            f"{env.name}/<mode>-seed<K>.json and start-<version>.json (move {env.name} elsewhere)"
        )
    return env_dir if env_dir.is_dir() else None


def _check_own(
    label: str, key: Key, data: dict[str, Any], folder: Path, protocol: Protocol, env: Environment
) -> None:
    """What one file must be on its own: of this protocol and environment, holding the compared
    metrics, and for a cell a planned mode and seed with the protocol's training config."""
    if data["protocol"]["hash"] != protocol.hash:
        raise ValueError(
            f"{label} was made under protocol {data['protocol']}, but {folder / 'protocol.toml'} "
            f"is {protocol.name} ({protocol.hash}): results of another protocol never mix"
        )
    if data["environment"] != env.name:
        raise ValueError(
            f"{label} belongs to environment {data['environment']!r}, not {env.name!r}"
        )
    for metric in protocol.held:  # the compared metrics and the baselines' values
        if metric not in data:
            raise ValueError(f"{label}: field {metric!r} (a compared metric) is missing")
    if key[0] == "start":
        return
    if key[1] not in env.modes:
        raise ValueError(f"{label}: mode {key[1]!r} is not in environment {env.name}")
    if key[2] >= env.seeds:
        raise ValueError(
            f"{label}: seed {key[2]} is outside the protocol's plan for {env.name} "
            f"(seeds {env.planned()})"
        )
    _check_config(label, data, protocol, env)


def load_env(folder: Path, protocol: Protocol, env: Environment) -> EnvCells:
    """The checked results of ``env`` under ``folder`` (none yet: an empty EnvCells)."""
    out = EnvCells(env, {}, {}, None, {})
    env_dir = _env_dir(folder, env)
    if env_dir is None:
        return out
    files = _read_folder(env_dir, env)
    for label, key, data in files:
        _check_own(label, key, data, folder, protocol, env)
        if out.claims is None:
            out.claims = list(data["claims"])
        elif data["claims"] != out.claims:
            raise ValueError(
                f"{label} was evaluated on other claims than the other cells of {env.name}"
            )
        if key[0] == "start":
            out.starts[key[1]] = data
            continue
        out.cells[key[1], key[2]] = data
        out.names[key[1], key[2]] = label
    _check_pins(env, files)
    _check_final_versions(out)
    _check_starts(out)
    return out


def check_strays(folder: Path, protocol: Protocol) -> None:
    """ValueError naming a folder beside the environments' that holds result files the protocol
    does not name (an environment renamed or dropped): its cells would be passed over."""
    for path in sorted(Path(folder).iterdir()):
        if not path.is_dir() or path.name.startswith(".") or path.name in protocol.environments:
            continue
        if any(RESULT_NAME.search(f.name) for f in path.glob("*.json")):
            raise ValueError(
                f"{path.name}/: holds result files, but the protocol {protocol.name} has no "
                f"environment {path.name!r} (it has {', '.join(protocol.environments)}): move "
                "the folder out of the results folder, or run it under a protocol that names it"
            )


def load_folder(folder: Path, protocol: Protocol) -> dict[str, EnvCells]:
    """Every environment's checked results (:func:`load_env`), after :func:`check_strays`."""
    check_strays(folder, protocol)
    return {name: load_env(folder, protocol, env) for name, env in protocol.environments.items()}


def refusals(folder: Path, protocol: Protocol) -> list[tuple[str, str]]:
    """Every file the aggregate would refuse, each with the reason: (its label, the message).
    Each file is checked on its own (its values, name, protocol, environment, mode, seed and
    config); an environment whose files all pass is then checked whole (:func:`load_env`: no
    two files for one cell, one claim set, one game, one start per seed, every start's
    evaluation present), its first problem labelled with the environment's folder."""
    found: list[tuple[str, str]] = []
    try:
        check_strays(folder, protocol)
    except ValueError as exc:
        found.append((str(exc).split(": ", 1)[0], str(exc)))
    for env in protocol.environments.values():
        try:
            env_dir = _env_dir(folder, env)
        except ValueError as exc:
            found.append((env.name, str(exc)))
            continue
        if env_dir is None:
            continue
        before = len(found)
        for path in _entries(env_dir):
            try:
                label, key, data = _read_one(path, env)
                _check_name(label, key, env)
                _check_own(label, key, data, folder, protocol, env)
            except ValueError as exc:
                found.append((f"{env.name}/{path.name}", str(exc)))
        if len(found) == before:
            try:
                load_env(folder, protocol, env)
            except ValueError as exc:
                found.append((f"{env.name}/", str(exc)))
    return found


def _check_config(label: str, data: dict[str, Any], protocol: Protocol, env: Environment) -> None:
    """The training config a cell stored is the one the protocol gives its mode and seed (a
    cell copied under another mode or seed, or trained with other settings, is refused)."""
    mode, seed, stored = data["mode"], data["seed"], data["config"]
    for name, want in (("credit", mode), ("seed", seed)):
        if stored.get(name) != want:
            raise ValueError(
                f"{label}: its config was trained with {name} {stored.get(name)!r}, but the file "
                f"says {name} {want!r}: a cell's file holds what that cell trained"
            )
    expected = protocol.train_config(env, mode, seed, data["pins"]["list_k"]).to_dict()
    try:
        same = TrainConfig.from_dict(stored).to_dict() == expected
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{label}: its config is not a training config ({exc})") from None
    if not same:
        raise ValueError(
            f"{label}: its config is not the one the protocol gives {mode}-seed{seed} "
            f"(trained with other settings than {protocol.name}'s)"
        )


PINNED_ALIKE = ("game", "retriever", "merge", "rrf_k", "anchor", "n_actions", "retrieval_k",
                "list_k", "index_version", "index_docs", "dataset_checksum", "precision")  # fmt: skip
"""Pins every file of one environment must share (where it names them: files written before a
pin existed lack it): the game, the index, its depths and the precisions."""


def _check_pins(env: Environment, files: list[tuple[str, Key, dict[str, Any]]]) -> None:
    """One game for the whole environment: every file's pins agree with the environment's
    settings and with each other (:data:`PINNED_ALIKE`)."""
    own = {"retriever": env.retriever, "merge": env.merge, "anchor": env.anchor,
           "n_actions": env.n_actions, "game": env.game, "retrieval_k": env.retrieval_k}  # fmt: skip
    first: dict[str, tuple[str, Any]] = {}
    for label, _, data in files:
        pins = data.get("pins")
        if not isinstance(pins, dict):
            continue
        for name in PINNED_ALIKE:
            if name not in pins:
                continue
            value = pins[name]
            if own.get(name) is not None and value != own[name]:
                raise ValueError(
                    f"{label}: pins.{name} = {value!r}, but environment {env.name} has "
                    f"{own[name]!r}: the file was made in another game"
                )
            seen = first.setdefault(name, (label, value))
            if seen[1] != value:
                raise ValueError(
                    f"{label}: pins.{name} = {value!r}, but {seen[0]} has {seen[1]!r}: the "
                    f"files of {env.name} were made in different games"
                )


def _check_final_versions(ec: EnvCells) -> None:
    """No two cells of different seeds end in the same trained weights (a cell copied over
    another seed, its labels and config edited). Cells of one seed may: where two modes give
    the same credit (one action: Shapley = singleton) they train the same policy. A cell whose
    weights did not move ends in its start's version and is exempt."""
    holder: dict[str, tuple[int, str]] = {}
    for key, cell in sorted(ec.cells.items()):
        version = cell["final_version"]
        if version == cell["start"]["version"]:
            continue
        seed, label = holder.setdefault(version, (key[1], ec.names[key]))
        if seed != key[1]:
            raise ValueError(
                f"{label} and {ec.names[key]} end in the same trained policy {version}: cells of "
                "different seeds never train the same weights; one is a copy"
            )


def _check_starts(ec: EnvCells) -> None:
    """The cells of one seed share one start, and every cell's start has its evaluation here."""
    by_seed: dict[int, set[str]] = {}
    for (_, seed), cell in sorted(ec.cells.items()):
        by_seed.setdefault(seed, set()).add(cell["start"]["version"])
    for seed, versions in sorted(by_seed.items()):
        if len(versions) > 1:
            raise ValueError(
                f"environment {ec.env.name}, seed {seed}: its cells started from different policies "
                f"{sorted(versions)}; a seed's cells must share one start"
            )
    for key, cell in sorted(ec.cells.items()):
        version = cell["start"]["version"]
        if version not in ec.starts:
            raise ValueError(
                f"{ec.names[key]}: its start {version} has no evaluation in {ec.env.name}/ "
                f"(start-{version}.json is missing): restore it, or run the cell's command again"
            )
