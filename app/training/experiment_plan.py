"""The plan of a credit-mode experiment (`app.training.experiment`): its cells (mode × seed) and
their run ids, the training config and environment every cell shares, stored in
``var/experiments/<name>/plan.json``; and the per-claim rows of every evaluation, stored in
``per_query/<mode>-s<seed>.json`` (``start.json`` for the starting policy) as they happen."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy.train_config import TrainConfig

ENVIRONMENT = ("policy", "evaluator", "retriever", "merge", "rrf_k")
"""Meta keys a resumed experiment must share with the stored one."""


@dataclass
class Cell:
    mode: str
    seed: int
    run_id: int | None = None
    done: bool = False


@dataclass
class Plan:
    name: str
    modes: list[str]
    seeds: list[int]
    config: dict[str, Any]  # the TrainConfig (credit and seed set per cell)
    meta: dict[str, Any]  # policy ref, evaluator, index slice
    cells: list[Cell] = field(default_factory=list)
    start_eval: dict[str, float] | None = None  # the starting policy, evaluated once

    def save(self, path: Path) -> None:
        data = {**self.__dict__, "cells": [c.__dict__ for c in self.cells]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Plan:
        data = json.loads(path.read_text())
        data["cells"] = [Cell(**c) for c in data["cells"]]
        return cls(**data)


def plain(obj: Any) -> Any:
    """``obj`` as stored JSON reads back (tuples become lists)."""
    return json.loads(json.dumps(obj))


def make_plan(
    folder: Path,
    name: str,
    modes: list[str],
    seeds: list[int],
    cfg: TrainConfig,
    meta: dict[str, Any],
) -> Plan:
    """A new plan, or the stored one (a restart must ask for the same experiment: the same
    modes, seeds, training config and environment)."""
    path = folder / "plan.json"
    if path.is_file():
        plan = Plan.load(path)
        if plan.modes != modes or plan.seeds != seeds:
            raise ValueError(
                f"experiment {name!r} exists with modes {plan.modes} and seeds {plan.seeds}: use another --name"
            )
        wanted = _comparable(cfg)
        stored = _comparable(TrainConfig.from_dict(plan.config))  # in today's layout
        changed = sorted(k for k in set(wanted) | set(stored) if wanted.get(k) != stored.get(k))
        changed += [
            k
            for k in ENVIRONMENT
            if k in meta and k in plan.meta and plain(meta[k]) != plan.meta[k]
        ]
        if changed:
            raise ValueError(
                f"experiment {name!r} exists with other settings ({', '.join(changed)}): "
                "rerun its command unchanged to resume it, or use another --name"
            )
        return plan
    folder.mkdir(parents=True, exist_ok=True)
    plan = Plan(name, modes, seeds, cfg.to_dict(), meta, [Cell(m, s) for s in seeds for m in modes])
    plan.save(path)
    return plan


GAME_PINS = ("game", "retrieval_k", "list_k", "index_version", "index_docs", "dataset_checksum")
"""What a plain experiment's cells are scored in, pinned at its first start (`pin_game`)."""


def game_pins(retrieval: Any, settings: Any) -> dict[str, Any]:
    """The game as built now: the value (CASI_GAME, its list depth), the index (its version
    hashes the corpus and the retriever's parameters: BM25 stemmer and rules, the embedder)
    and its size, each action's depth, the dataset's bytes."""
    from app.training.units import folder_checksum

    return {
        "game": str(settings.game),
        "retrieval_k": int(settings.retrieval_k),
        "list_k": int(settings.list_k),
        "index_version": str(retrieval.index.version),
        "index_docs": len(retrieval.index),
        "dataset_checksum": folder_checksum(Path(settings.dataset)),
    }


def pin_game(plan: Plan, pins: dict[str, Any]) -> None:
    """Pin ``pins`` in the plan at its first start; a resume in another game is refused (its
    cells would be scored differently from the finished ones, and the table would mix them)."""
    stored = plan.meta.get("game_pins")
    if stored is None:  # a new experiment, or one stored before games were pinned
        plan.meta["game_pins"] = plain(pins)
        return
    changed = [f"{k} {stored.get(k)} → {pins[k]}" for k in GAME_PINS if stored.get(k) != pins[k]]
    if changed:
        raise ValueError(
            f"experiment {plan.name!r} started in another game ({'; '.join(changed)}): rerun it "
            "with the settings it started with (CASI_DATASET, CASI_GAME, CASI_RETRIEVAL_K, "
            "CASI_LIST_K, CASI_BM25_*), or use another --name"
        )


def _comparable(cfg: TrainConfig) -> dict[str, Any]:
    """The config by option name (``lr``, not the ``update`` section) and the preset's sections
    by name: what a "changed settings" error lists."""
    stored = plain(cfg.to_dict())
    options = {o.name: plain(getattr(getattr(cfg, o.path[0]), o.path[1]) if len(o.path) == 2 else stored[o.name])
               for o in TrainConfig.options()}  # fmt: skip
    sections = {"rollout", "sampler", "update", "params", "eval"}
    return {**{k: v for k, v in stored.items() if k not in sections}, **options}


def cell_key(mode: str, seed: int) -> str:
    return f"{mode}-s{seed}"


def _per_query_path(folder: Path, key: str) -> Path:
    return folder / "per_query" / f"{key}.json"


def load_per_query(folder: Path, key: str) -> dict[int, list[dict[str, Any]]]:
    """The per-claim rows of every stored evaluation of ``key`` (a cell, or ``start``), by step."""
    path = _per_query_path(folder, key)
    if not path.is_file():
        return {}
    return {int(k): v for k, v in json.loads(path.read_text()).items()}


def _write_per_query(folder: Path, key: str, by_step: dict[int, list[dict[str, Any]]]) -> None:
    path = _per_query_path(folder, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(k): v for k, v in sorted(by_step.items())}))
    tmp.replace(path)


def save_per_query(folder: Path, key: str, step: int, rows: list[dict[str, Any]]) -> None:
    """Store one evaluation's per-claim rows (atomic: a kill leaves the old file or the new)."""
    by_step = load_per_query(folder, key)
    by_step[step] = rows
    _write_per_query(folder, key, by_step)


def drop_per_query_after(folder: Path, key: str, step: int) -> None:
    """A resumed cell recomputes every step after ``step``: drop their rows (as the database
    rows are dropped), so what is stored is what the finished run evaluated."""
    by_step = load_per_query(folder, key)
    if any(s > step for s in by_step):
        _write_per_query(folder, key, {s: v for s, v in by_step.items() if s <= step})
