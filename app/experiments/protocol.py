"""The credit experiment's pre-registered protocol (a TOML file): :func:`load_protocol` reads and
checks it, :func:`protocol_hash` names it. It fixes the start recipe, the training settings, the
held-out evaluation, the environments (retriever × merge rule × anchor × m, each with its credit
modes), the hypotheses and the analysis; `app.experiments.cell` runs its cells and
`app.experiments.aggregate` turns them into the answer.

Every key is checked when the file is read, against one rule table per TOML table
(`app.experiments.protocol_keys`; [training] against `TrainConfig`'s options): its type, its
range, and for names the registry they come from (retrievers, `MERGE_RULES`, splits,
`CREDIT_MODES`, `HYPOTHESIS_KINDS`). An error is one line with the key's path:
``protocol p.toml: [environments.main] rrf_k = [1]: must be a number >= 0``. A key a
protocol does not write keeps its default and does not enter the hash.

Optional keys for a policy that reads its first retrieval (issue 50): ``[start]
feedback_words`` (with ``source = "prf"`` and ``prompt = "feedback"``: the teacher's warm
start); ``[evaluation] curve_split`` (dev or val, never test), ``curve_every`` (steps) and
``curve_queries`` ("all" or N): a learning curve inside each cell (:attr:`Protocol.curve`);
``[evaluation] refuse_degenerate``: every held-out evaluation decodes as serving does, with the
degenerate guard (:attr:`Protocol.refuse_degenerate`); a hypothesis' ``b`` may name a baseline
(:data:`BASELINE_METRICS`: ``keyword_expansion``, ``query``, ``budget``) instead of a mode,
whose per-claim values are read off A's cells.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.experiments.protocol_keys import (
    ANALYSIS_KEYS,
    ENVIRONMENT_KEYS,
    EVALUATION_KEYS,
    HYPOTHESIS_KEYS,
    START_KEYS,
    UNPINNED_TRAINING,
    Reader,
    integer,
    read_toml,
    text,
    training_keys,
)
from app.experiments.result_file import DEFAULT_METRIC
from evaluator.games import GAMES
from policy.train_config import TrainConfig

ENV_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""An environment's name is its results folder's name."""
BASELINE_METRICS: dict[str, dict[str, str]] = {
    "keyword_expansion": {
        "pool_recall": "prf_recall", "served_ndcg@10": "prf_served_ndcg@10",
        "ndcg@10": "prf_ndcg@10",
    },
    "query": {
        "pool_recall": "query_pool_recall", "ndcg@10": "query_ndcg@10",
        "served_ndcg@10": "query_ndcg@10",  # the query alone is served as its own list
    },
    "budget": {"pool_recall": "budget_recall"},
}  # fmt: skip
"""The baselines a hypothesis' ``b`` may name instead of a mode: {baseline: {compared metric:
the per-claim key of A's cells holding the baseline's value}}. A baseline is deterministic (no
policy), the same in every cell: B's values are read off the A cell of the same seed."""


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
    seeds: int  # the planned seeds are 0..seeds-1: the cells run and aggregated, no others
    game: str = "list"  # the credit game (evaluator.games): list | pool
    retrieval_k: int | None = None  # documents per action (None: the machine's CASI_RETRIEVAL_K)

    def planned(self) -> str:
        """The planned seeds in `--seeds` syntax: ``0-5`` (``0`` for one seed)."""
        return "0" if self.seeds == 1 else f"0-{self.seeds - 1}"


@dataclass(frozen=True)
class Hypothesis:
    """A planned comparison of mode ``a`` with mode ``b`` in ``environment``: ``greater`` (a > b,
    one-sided), ``equivalent`` (|a − b| < the analysis margin, two one-sided tests) or
    ``two_sided`` (a ≠ b), on ``metric`` (None: the protocol's ``[analysis] metric``). ``b``
    may name a baseline (:data:`BASELINE_METRICS`) instead of a mode."""

    name: str
    environment: str
    a: str
    b: str
    kind: str
    family: str  # Holm corrects within a family
    metric: str | None = None


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
    analysis: dict[str, Any]  # resamples, seed, alpha, margin (metric: optional)
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def metric(self) -> str:
        """The per-claim metric the hypotheses compare (``[analysis] metric``, default
        `DEFAULT_METRIC`)."""
        return str(self.analysis.get("metric", DEFAULT_METRIC))

    def metric_of(self, h: Hypothesis) -> str:
        """The per-claim metric hypothesis ``h`` compares (its own, else the protocol's)."""
        return h.metric or self.metric

    def baseline_key(self, h: Hypothesis) -> str | None:
        """The per-claim key of A's cells that holds B's values when ``h.b`` names a baseline
        (:data:`BASELINE_METRICS`), else None (B is a mode: its own cells)."""
        if h.b in self.environments[h.environment].modes:
            return None
        return BASELINE_METRICS[h.b][self.metric_of(h)]

    @property
    def held(self) -> tuple[str, ...]:
        """Every per-claim key each result file must hold: the compared metrics and the
        baselines' keys the hypotheses read."""
        keys = [self.baseline_key(h) for h in self.hypotheses]
        return tuple(dict.fromkeys([*self.metrics, *(k for k in keys if k is not None)]))

    @property
    def curve(self) -> dict[str, Any] | None:
        """The learning curve each cell records (``split``, ``every``, ``queries``), or None
        when the protocol's [evaluation] names no ``curve_split``."""
        e = self.evaluation
        if "curve_split" not in e:
            return None
        return {"split": e["curve_split"], "every": int(e["curve_every"]),
                "queries": e.get("curve_queries", "all")}  # fmt: skip

    @property
    def refuse_degenerate(self) -> bool:
        """Whether every held-out evaluation decodes with serving's degenerate guard
        (``[evaluation] refuse_degenerate``, default false: the rewrites as the policy writes
        them)."""
        return bool(self.evaluation.get("refuse_degenerate", False))

    @property
    def metrics(self) -> tuple[str, ...]:
        """Every per-claim metric a hypothesis compares (each result file must hold them)."""
        return tuple(dict.fromkeys([self.metric, *(self.metric_of(h) for h in self.hypotheses)]))

    @property
    def dataset(self) -> str | None:
        """The dataset folder the protocol names (top-level ``dataset``), else None (the
        machine's CASI_DATASET)."""
        value = self.raw.get("dataset")
        return str(value) if value is not None else None

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


def _environments(r: Reader, data: Mapping[str, Any]) -> dict[str, Environment]:
    tables = r.table(data, "environments")
    if not tables:
        r.fail("[environments]", "names no environment")
    envs = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            r.bad("environments", name, table, "must be a table")
        if not ENV_NAME.fullmatch(name):
            r.fail(f"[environments.{name}]", "an environment's name must be a folder name "
                   "(letters, digits, _ . -)")  # fmt: skip
        r.check(table, ENVIRONMENT_KEYS, f"environments.{name}")
        game = table.get("game", "list")
        if (GAMES[game].merge == "pool") != (table["merge"] == "pool"):
            r.bad(f"environments.{name}", "merge", table["merge"],
                  f"is not game {game!r}'s rule (the pool game pools, the list game cuts: "
                  "max or rrf)")  # fmt: skip
        envs[name] = Environment(
            name, table["retriever"], table["merge"], float(table.get("rrf_k", 60.0)),
            table.get("anchor", True), table["n_actions"], tuple(table["modes"]), table["seeds"],
            game, table.get("retrieval_k"),
        )  # fmt: skip
    return envs


def _hypotheses(
    r: Reader, items: Any, envs: Mapping[str, Environment], analysis_metric: str
) -> tuple[Hypothesis, ...]:
    if not isinstance(items, list):
        r.bad("", "hypotheses", items, "must be an array of tables ([[hypotheses]])")
    hyps: list[Hypothesis] = []
    for i, item in enumerate(items):
        where = f"hypotheses[{i}]"
        if not isinstance(item, dict):
            r.bad("", where, item, f"must be a table with {', '.join(HYPOTHESIS_KEYS)}")
        r.check(item, HYPOTHESIS_KEYS, where)
        h = Hypothesis(item["name"], item["environment"], item["a"], item["b"], item["kind"],
                       item.get("family", "primary"), item.get("metric"))  # fmt: skip
        if h.environment not in envs:
            r.bad(where, "environment", h.environment, f"must be one of {', '.join(envs)}")
        modes = envs[h.environment].modes
        if h.a not in modes:
            r.bad(where, "a", h.a, f"not in its environment's modes ({', '.join(modes)})")
        metric = h.metric or analysis_metric
        if h.b not in modes and metric not in BASELINE_METRICS.get(h.b, {}):
            usable = [b for b, keys in BASELINE_METRICS.items() if metric in keys]
            r.bad(where, "b", h.b, f"not in its environment's modes ({', '.join(modes)}) "
                  f"nor a baseline of {metric} ({', '.join(usable) or 'none'})")  # fmt: skip
        if h.a == h.b:
            r.bad(where, "b", h.b, "must differ from a")
        if any(h.name == other.name for other in hyps):
            r.bad(where, "name", h.name, "is the name of another hypothesis")
        hyps.append(h)
    return tuple(hyps)


def _check_pairs(r: Reader, start: Mapping[str, Any], evaluation: Mapping[str, Any]) -> None:
    """Keys that only work together: the teacher (source prf) with the feedback prompt, a
    curve's split with its interval."""
    prf, feedback = start.get("source") == "prf", start["prompt"] == "feedback"
    if prf != feedback:
        r.bad("start", "source", start.get("source", "titles"), "source prf and prompt feedback "
              "go together (the teacher's rewrites are read from the feedback context)")  # fmt: skip
    if "feedback_words" in start and not prf:
        r.bad("start", "feedback_words", start["feedback_words"], 'needs source = "prf"')
    curve = [k for k in ("curve_split", "curve_every", "curve_queries") if k in evaluation]
    if curve and not {"curve_split", "curve_every"} <= set(curve):
        r.bad("evaluation", curve[0], evaluation[curve[0]],
              "a learning curve needs both curve_split and curve_every")  # fmt: skip


def load_protocol(path: Path) -> Protocol:
    """Read and check a protocol file; ValueError (one line, the key's path) names what is wrong."""
    data = read_toml(path)
    r = Reader(path)
    top = {"name": text(), "max_docs": integer(1, required=False), "dataset": text(required=False)}
    r.check({k: v for k, v in data.items() if k in top}, top, "")
    tables = ("start", "training", "evaluation", "environments", "hypotheses", "analysis")
    if unknown := [k for k in data if k not in top and k not in tables]:
        r.bad("", unknown[0], data[unknown[0]], f"unknown key; known: {', '.join([*top, *tables])}")
    start, training = r.table(data, "start"), r.table(data, "training")
    evaluation, analysis = r.table(data, "evaluation"), r.table(data, "analysis")
    r.check(start, START_KEYS, "start")
    if bad := [k for k in training if k in UNPINNED_TRAINING]:
        r.bad("training", bad[0], training[bad[0]], "may not be set here (cells set credit and "
              "seed, environments n_actions and anchor, [evaluation] the held-out evaluation)")  # fmt: skip
    r.check(training, training_keys(), "training")
    r.check(evaluation, EVALUATION_KEYS, "evaluation")
    _check_pairs(r, start, evaluation)
    r.check(analysis, ANALYSIS_KEYS, "analysis")
    envs = _environments(r, data)
    protocol = Protocol(
        data["name"], protocol_hash(data), start, training, evaluation, data.get("max_docs"),
        envs, _hypotheses(r, data.get("hypotheses", []), envs,
                          str(analysis.get("metric", DEFAULT_METRIC))), analysis, data,
    )  # fmt: skip
    for env in envs.values():  # every cell's config must be valid now, not after hours
        for mode in env.modes:
            try:
                protocol.train_config(env, mode, 0, 10)
            except (ValueError, TypeError) as exc:
                r.fail(f"[training] with [environments.{env.name}], mode {mode}", str(exc))
    return protocol
