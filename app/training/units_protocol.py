"""The credit experiment's pre-registered protocol (a TOML file): :func:`load_protocol` reads and
checks it, :func:`protocol_hash` names it. It fixes the start recipe, the training settings, the
held-out evaluation, the environments (retriever × merge rule × anchor × m, each with its credit
modes), the hypotheses and the analysis; `app.training.units` runs its cells and
`app.training.units_aggregate` turns them into the answer."""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy.train_config import TrainConfig

PINNED_PRECISIONS = ("float32", "bfloat16")
HYPOTHESIS_KINDS = ("greater", "equivalent")
UNPINNED_TRAINING = ("credit", "seed", "n_actions", "anchor", "eval_queries", "eval_every")
"""Training options a protocol's [training] table may not set: the cell (credit, seed), the
environment (n_actions, anchor) and the protocol's [evaluation] set them."""


@dataclass(frozen=True)
class Environment:
    """One game: retriever × merge rule (× rrf k) × the query as anchor × m, and its modes."""

    name: str
    retriever: str
    merge: str
    rrf_k: float
    anchor: bool
    n_actions: int
    modes: tuple[str, ...]
    seeds: int  # cells per mode the protocol asks for (at least)


@dataclass(frozen=True)
class Hypothesis:
    """A planned comparison of mode ``a`` with mode ``b`` in ``environment``: ``greater`` (a > b,
    one-sided) or ``equivalent`` (|a − b| < the analysis margin, two one-sided tests)."""

    name: str
    environment: str
    a: str
    b: str
    kind: str
    family: str  # Holm corrects within a family


@dataclass(frozen=True)
class Protocol:
    name: str
    hash: str
    start: dict[str, Any]  # the warm-start recipe (`casi policy warmstart` options)
    training: dict[str, Any]  # TrainConfig options every cell shares (plus "preset")
    evaluation: dict[str, Any]  # split, queries ("all" or N)
    max_docs: int | None
    environments: dict[str, Environment]
    hypotheses: tuple[Hypothesis, ...]
    analysis: dict[str, Any]  # resamples, seed, alpha, margin
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    def environment(self, name: str) -> Environment:
        if name not in self.environments:
            raise ValueError(
                f"the protocol {self.name!r} has no environment {name!r}; it has {sorted(self.environments)}"
            )
        return self.environments[name]

    def train_config(self, env: Environment, mode: str, seed: int, list_k: int) -> TrainConfig:
        """The TrainConfig of one cell (the held-out evaluation runs outside the training loop)."""
        options = {k: v for k, v in self.training.items() if k != "preset"}
        return TrainConfig.from_preset(
            self.training.get("preset", "casi"), **options, credit=mode, seed=seed,
            n_actions=env.n_actions, anchor_query=env.anchor, list_k=list_k,
            eval_queries=0, eval_every=0,
        )  # fmt: skip


def protocol_hash(data: Mapping[str, Any]) -> str:
    """sha256 (16 hex) of the parsed protocol as canonical JSON: comments and layout do not count."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _need(table: Mapping[str, Any], key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in table:
        raise ValueError(f"protocol: [{where}] needs {key!r}")
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ValueError(f"protocol: [{where}] {key} = {value!r} has the wrong type")
    return value


def load_protocol(path: Path) -> Protocol:
    """Read and check a protocol file; ValueError names what is wrong."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"no protocol file {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"protocol {path} is not valid TOML: {exc}") from None
    name = _need(data, "name", "top level", str)
    start = dict(_need(data, "start", "top level", dict))
    training = dict(_need(data, "training", "top level", dict))
    evaluation = dict(_need(data, "evaluation", "top level", dict))
    analysis = dict(_need(data, "analysis", "top level", dict))
    for key in ("precision", "train_precision"):
        if training.get(key) not in PINNED_PRECISIONS:
            raise ValueError(
                f"protocol: [training] {key} must be pinned to one of {list(PINNED_PRECISIONS)} "
                f"(never auto: it resolves differently per machine), got {training.get(key)!r}"
            )
    if start.get("train_precision") not in PINNED_PRECISIONS:
        raise ValueError("protocol: [start] train_precision must be float32 or bfloat16")
    if bad := sorted(set(training) & set(UNPINNED_TRAINING)):
        raise ValueError(f"protocol: [training] may not set {bad} (cells and environments do)")
    queries = evaluation.get("queries")
    if not (queries == "all" or isinstance(queries, int) and queries >= 1):
        raise ValueError(f"protocol: [evaluation] queries must be 'all' or N >= 1, got {queries!r}")
    if evaluation.get("precision", "float32") != "float32":
        raise ValueError("protocol: [evaluation] precision must be float32 (held-out is float32)")
    envs: dict[str, Environment] = {}
    for env_name, table in _need(data, "environments", "top level", dict).items():
        where = f"environments.{env_name}"
        modes = tuple(_need(table, "modes", where, list))
        if not modes or len(set(modes)) != len(modes):
            raise ValueError(f"protocol: [{where}] modes must be distinct and non-empty")
        envs[env_name] = Environment(
            env_name, _need(table, "retriever", where, str), _need(table, "merge", where, str),
            float(table.get("rrf_k", 60.0)), bool(table.get("anchor", True)),
            int(_need(table, "n_actions", where, int)), modes, int(_need(table, "seeds", where, int)),
        )  # fmt: skip
    hyps = []
    for item in data.get("hypotheses", []):
        h = Hypothesis(
            str(item.get("name")), str(item.get("environment")), str(item.get("a")),
            str(item.get("b")), str(item.get("kind")), str(item.get("family", "primary")),
        )  # fmt: skip
        if h.environment not in envs:
            raise ValueError(
                f"protocol: hypothesis {h.name!r} names no environment {h.environment!r}"
            )
        if h.a not in envs[h.environment].modes or h.b not in envs[h.environment].modes:
            raise ValueError(
                f"protocol: hypothesis {h.name!r} compares modes not in its environment"
            )
        if h.kind not in HYPOTHESIS_KINDS:
            raise ValueError(
                f"protocol: hypothesis {h.name!r} kind must be one of {list(HYPOTHESIS_KINDS)}"
            )
        hyps.append(h)
    for key in ("resamples", "seed", "alpha", "margin"):
        _need(analysis, key, "analysis", (int, float))
    max_docs = data.get("max_docs")
    if max_docs is not None and not (isinstance(max_docs, int) and max_docs >= 1):
        raise ValueError(f"protocol: max_docs must be a number of documents >= 1, got {max_docs!r}")
    protocol = Protocol(
        name, protocol_hash(data), start, training, evaluation, max_docs, envs,
        tuple(hyps), analysis, data,
    )  # fmt: skip
    for env in envs.values():  # every cell's config must be valid now, not after hours
        for mode in env.modes:
            protocol.train_config(env, mode, 0, 10)
    return protocol
