"""One result file of a protocol: its name, how it is written and read, what it holds, and the
check every reader runs before using a value.

Read :func:`read_result`, then :func:`check_result`. `app.experiments.cell` writes two kinds of
file, told apart by their ``format``: a cell (:data:`CELL_FORMAT`), named by :func:`cell_path`
(``<out>/<environment>/<mode>-seed<K>.json``), and a start's evaluation (:data:`START_FORMAT`),
named by :func:`start_path` (``<out>/<environment>/start-<version>.json``); both through
:func:`write_json` (atomic, sorted keys: the same data gives the same bytes).
:data:`RESULT_FORMATS` lists what each format must hold; :data:`PER_CLAIM_METRICS`,
:data:`NUMBERS` and :data:`STEP_NUMBERS` give every known value's range. A bad file is one
line naming the file and the field (``main/shapley-seed3.json: field 'ndcg@10'[17] = 7.0 is
outside [0, 1]``), never a TypeError or KeyError further on. A cell of a protocol with a
learning curve also holds ``curve`` (:func:`curve_point` per evaluation: steps ascending,
:data:`CURVE_METRICS` in [0, 1]), checked wherever present.

Adding a metric is one line: a per-claim metric (a list of one value per claim) goes into
:data:`PER_CLAIM_METRICS` with its range and is checked in every file that holds it; a
per-cell number (``overlap``, ``compute.eval_s``) into :data:`NUMBERS`. A format that must hold
it names it in its :class:`ResultFormat` (a new format string for files that hold new fields).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from evaluator.artifacts import atomic_write_text

CELL_FORMAT = "casi-credit-cell/1"
START_FORMAT = "casi-credit-start/1"

UNIT = (0.0, 1.0)
NON_NEGATIVE = (0.0, math.inf)
FINITE = (-math.inf, math.inf)

PER_CLAIM_METRICS: dict[str, tuple[float, float]] = {
    "ndcg@10": UNIT,  # query + rewrites on the game's own depth-10 fusion: what CASI serves
    "recall@100": UNIT,  # query + rewrites, depth-100 fused lists
    "query_ndcg@10": UNIT,  # the query alone
    # the pooled game (CASI_GAME=pool): graded recall of pools, the baselines, the mechanism
    "pool_recall": UNIT,  # query + rewrites' pool: v(N)
    "query_pool_recall": UNIT,  # the query's own list at depth k: v(∅)
    "budget_recall": UNIT,  # the query alone at depth (m + 1)·k: the equal-budget baseline
    "prf_recall": UNIT,  # keyword expansion's m rewrites + the query: the non-learned baseline
    "prf_ndcg@10": UNIT,  # keyword expansion's served list
    "overlap": UNIT,  # the share of the rewrites' distinct documents two or more found
    "served_ndcg@10": UNIT,  # query + rewrites' pool as served: re-ranked by the second stage
    "prf_served_ndcg@10": UNIT,  # keyword expansion's pool as served
}
"""Every per-claim metric a result file may hold, with its closed range: a list of one finite
number per claim, in the order of the file's ``claims``."""

DEFAULT_METRIC = "ndcg@10"
"""The per-claim metric the hypotheses compare when the protocol's ``[analysis] metric`` names
none (a protocol that omits the key keeps its hash)."""

NUMBERS: dict[str, tuple[float, float]] = {
    "compute.wall_s": NON_NEGATIVE,
    "compute.train_s": NON_NEGATIVE,
    "compute.eval_s": NON_NEGATIVE,
    "eval_metrics.overlap": UNIT,  # the pooled game's mechanism (the aggregate's table of it)
    "eval_metrics.duplicate_rate": UNIT,
    "eval_metrics.unique_gain_share": UNIT,
    "eval_metrics.degenerate_rate": UNIT,  # rewrites that are strings of repeats
}
"""Every single number a result file may hold (a dotted path into the file), with its range;
checked wherever present."""

CURVE_METRICS: dict[str, str] = {
    "pool_recall": "combined_pool_recall",  # the pooled game's
    "prf_pool_recall": "prf_pool_recall",
    "served_ndcg@10": "served_ndcg@10",
    "budget_pool_recall": "budget_pool_recall",
    "ndcg@10": "combined_ndcg@10",  # the list game's
}
"""A learning-curve point's values (each in [0, 1]): {its key in ``curve``: the evaluation's
metric it is the mean of (`policy.evaluate`)}; a point holds those its evaluation has, the list
game's ``ndcg@10`` only where the pooled game's are absent."""

STEP_NUMBERS: dict[str, tuple[float, float]] = {
    "reward_mean": FINITE,  # the training reward v(N), mean over the step's rollouts
    "adv_abs_mean": NON_NEGATIVE,  # mean |token advantage|
}
"""Per-step values of a cell's ``steps`` the aggregate reads; checked wherever present."""


@dataclass(frozen=True)
class ResultFormat:
    """What a file of one ``format`` must hold (dotted paths into the file)."""

    strings: tuple[str, ...]
    """Non-empty strings."""
    integers: tuple[str, ...]
    """Integers >= 0 (never a bool, a float or a string)."""
    numbers: tuple[str, ...]
    """Keys of :data:`NUMBERS`."""
    per_claim: tuple[str, ...]
    """Keys of :data:`PER_CLAIM_METRICS`."""
    steps: tuple[str, ...] = ()
    """Keys of :data:`STEP_NUMBERS` every entry of ``steps`` (a list) must hold; () for a file
    without ``steps``."""


_IDENTITY = ("environment", "protocol.name", "protocol.hash", "start.version")
_EVALUATION = ("ndcg@10", "recall@100", "query_ndcg@10")
RESULT_FORMATS: dict[str, ResultFormat] = {
    CELL_FORMAT: ResultFormat(
        strings=(*_IDENTITY, "mode", "final_version"),
        integers=("seed", "pins.list_k"),
        numbers=("compute.wall_s",),
        per_claim=_EVALUATION,
        steps=("reward_mean",),
    ),
    START_FORMAT: ResultFormat(strings=_IDENTITY, integers=(), numbers=(), per_claim=_EVALUATION),
}
"""Each result format and what its files must hold (a cell also its ``config``, an object:
`app.experiments.results_folder` compares it with the protocol's)."""

VERSIONS = ("start.version", "final_version")
"""Policy versions a file names: a weight hash, 6 to 64 lower-case hex digits."""
VERSION = re.compile(r"[0-9a-f]{6,64}")


class _Missing:
    pass


MISSING = _Missing()


def lookup(data: Mapping[str, Any], path: str, label: str) -> Any:
    """``data`` at a dotted ``path`` (MISSING when absent); a non-object on the way is an error."""
    node: Any = data
    walked: list[str] = []
    for part in path.split("."):
        if not isinstance(node, Mapping):
            _bad(label, repr(".".join(walked)), node, "must be an object")
        if part not in node:
            return MISSING
        node = node[part]
        walked.append(part)
    return node


def _bad(label: str, field: str, value: Any, problem: str) -> NoReturn:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise ValueError(f"{label}: field {field} = {shown} {problem}")


def _require(data: Mapping[str, Any], path: str, label: str) -> Any:
    value = lookup(data, path, label)
    if value is MISSING:
        raise ValueError(f"{label}: field {path!r} is missing")
    return value


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_number(x: Any, bounds: tuple[float, float], label: str, field: str) -> float:
    """``x`` as a float when it is a finite number within ``bounds`` (closed), else ValueError."""
    if not _is_number(x):
        _bad(label, field, x, "is not a number")
    if not math.isfinite(x):
        _bad(label, field, x, "is not a finite number")
    low, high = bounds
    if not low <= x <= high:
        if math.isinf(high):
            _bad(label, field, x, f"is below {low:g}")
        _bad(label, field, x, f"is outside [{low:g}, {high:g}]")
    return float(x)


def _check_claims(data: Mapping[str, Any], label: str) -> int:
    claims = _require(data, "claims", label)
    if not isinstance(claims, list) or not claims:
        _bad(label, "'claims'", claims, "must be a non-empty list of claim ids")
    seen: set[str] = set()
    for i, claim in enumerate(claims):
        if not isinstance(claim, str) or not claim:
            _bad(label, f"'claims'[{i}]", claim, "is not a claim id (a non-empty string)")
        if claim in seen:
            _bad(label, f"'claims'[{i}]", claim, "appears twice")
        seen.add(claim)
    return len(claims)


def _check_per_claim(values: Any, key: str, n_claims: int, label: str) -> None:
    if not isinstance(values, list):
        _bad(label, repr(key), values, "must be a list of one number per claim")
    if len(values) != n_claims:
        raise ValueError(f"{label}: field {key!r} has {len(values)} values for {n_claims} claims")
    for i, x in enumerate(values):
        check_number(x, PER_CLAIM_METRICS[key], label, f"{key!r}[{i}]")


def _check_steps(data: Mapping[str, Any], required: tuple[str, ...], label: str) -> None:
    steps = _require(data, "steps", label)
    if not isinstance(steps, list):
        _bad(label, "'steps'", steps, "must be a list of per-step objects")
    for i, step in enumerate(steps):
        if not isinstance(step, Mapping):
            _bad(label, f"'steps'[{i}]", step, "must be an object")
        for key in required:
            if key not in step:
                raise ValueError(f"{label}: field 'steps'[{i}].{key} is missing")
        for key, bounds in STEP_NUMBERS.items():
            if key in step:
                check_number(step[key], bounds, label, f"'steps'[{i}].{key}")


def curve_point(step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
    """One point of a cell's learning curve from an evaluation's ``metrics``
    (:data:`CURVE_METRICS`)."""
    pooled = "combined_pool_recall" in metrics
    return {"step": int(step), **{
        key: float(metrics[src]) for key, src in CURVE_METRICS.items()
        if src in metrics and (pooled != (key == "ndcg@10"))
    }}  # fmt: skip


def _check_curve(data: Mapping[str, Any], label: str) -> None:
    """A cell's ``curve`` (where present): a list of points, steps ascending integers >= 1,
    every other value a :data:`CURVE_METRICS` key in [0, 1]."""
    curve = data["curve"]
    if not isinstance(curve, list):
        _bad(label, "'curve'", curve, "must be a list of {step, metric: value} points")
    last = 0
    for i, point in enumerate(curve):
        if not isinstance(point, Mapping):
            _bad(label, f"'curve'[{i}]", point, "must be an object")
        step = point.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step <= last:
            _bad(label, f"'curve'[{i}].step", step, f"must be an integer step after {last}")
        last = step
        for key, value in point.items():
            if key != "step" and key not in CURVE_METRICS:
                _bad(label, f"'curve'[{i}].{key}", value,
                     f"is not a curve metric ({', '.join(CURVE_METRICS)})")  # fmt: skip
            if key != "step":
                check_number(value, UNIT, label, f"'curve'[{i}].{key}")


def _check_step_count(data: Mapping[str, Any], label: str) -> None:
    """A cell's ``steps`` holds one entry per step its config trains: a file with fewer (an
    empty or cut list) would change the per-step columns of the table it enters."""
    trained = data["config"].get("steps")
    if isinstance(trained, int) and not isinstance(trained, bool) and len(data["steps"]) != trained:
        raise ValueError(
            f"{label}: field 'steps' has {len(data['steps'])} entries, but its config trains "
            f"{trained} steps: a cell's file holds every step it trained"
        )


def _check_pins(data: Mapping[str, Any], label: str) -> None:
    """The machine a result names (``pins.cpu_model``, ``pins.isa_flags``), when present."""
    cpu = lookup(data, "pins.cpu_model", label)
    if cpu is not MISSING and cpu is not None and not isinstance(cpu, str):
        _bad(label, "'pins.cpu_model'", cpu, "must be a string")
    flags = lookup(data, "pins.isa_flags", label)
    if (
        flags is not MISSING
        and flags is not None
        and not (isinstance(flags, list) and all(isinstance(f, str) for f in flags))
    ):
        _bad(label, "'pins.isa_flags'", flags, "must be a list of strings")


def check_result(data: Any, label: str) -> dict[str, Any]:
    """``data`` (a parsed result file) when it holds everything its format requires, every
    value of the right type and in range, every per-claim list one value per claim; else
    ValueError ``<label>: field …``. The file's format must be known."""
    if not isinstance(data, dict) or data.get("format") not in RESULT_FORMATS:
        known = ", ".join(RESULT_FORMATS)
        raise ValueError(f"{label} is not a CASI credit-cell result (its 'format' is not {known})")
    spec = RESULT_FORMATS[data["format"]]
    for path in spec.strings:
        value = _require(data, path, label)
        if not isinstance(value, str) or not value:
            _bad(label, repr(path), value, "must be a non-empty string")
    for path in VERSIONS:
        value = lookup(data, path, label)
        if isinstance(value, str) and value and not VERSION.fullmatch(value):
            _bad(label, repr(path), value, "is not a policy version (6 to 64 hex digits)")
    if data["format"] == CELL_FORMAT and not isinstance(_require(data, "config", label), Mapping):
        _bad(label, "'config'", data["config"], "must be an object (the cell's training config)")
    for path in spec.integers:
        value = _require(data, path, label)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            _bad(label, repr(path), value, "must be an integer >= 0")
    for path in spec.numbers:
        _require(data, path, label)
    for path, bounds in NUMBERS.items():
        if (value := lookup(data, path, label)) is not MISSING:
            check_number(value, bounds, label, repr(path))
    n_claims = _check_claims(data, label)
    for key in spec.per_claim:
        _require(data, key, label)
    for key in PER_CLAIM_METRICS:
        if key in data:
            _check_per_claim(data[key], key, n_claims, label)
    if spec.steps:
        _check_steps(data, spec.steps, label)
        _check_step_count(data, label)
    if "curve" in data:
        _check_curve(data, label)
    _check_pins(data, label)
    return data


# ---------------------------------------------------------------------------- files


def cell_path(out: Path, environment: str, mode: str, seed: int) -> Path:
    return Path(out) / environment / f"{mode}-seed{seed}.json"


def start_path(out: Path, environment: str, version: str) -> Path:
    return Path(out) / environment / f"start-{version}.json"


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Atomically (a temporary file of its own beside ``path``, then rename), sorted keys,
    1-space indent: the same data gives the same bytes, and two writers never share a file."""
    atomic_write_text(Path(path), json.dumps(data, indent=1, sort_keys=True) + "\n")


def read_result(path: Path, label: str | None = None) -> dict[str, Any]:
    """A result file, read and checked (:func:`check_result`); errors name
    it as ``label`` (default: its path)."""
    name = label or str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{name} is not a readable result file: {exc}") from None
    return check_result(data, name)
