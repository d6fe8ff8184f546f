"""The rule tables of a protocol file (`app.experiments.protocol`): one :class:`Rule` per key of
each TOML table (:data:`START_KEYS`, :data:`EVALUATION_KEYS`, :data:`ENVIRONMENT_KEYS`,
:data:`HYPOTHESIS_KEYS`, :data:`ANALYSIS_KEYS`; [training] from `TrainConfig`'s options by
:func:`training_keys`), the limits they name, and :class:`Reader`, which checks one table against
its rules and words every error as one line with the key's path.
"""

from __future__ import annotations

import math
import tomllib
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from app.experiments.result_file import PER_CLAIM_METRICS
from app.settings import BM25_STEMMER_SETTINGS
from app.training.splits import SPLITS
from evaluator.bm25 import RULES as BM25_RULES
from evaluator.games import GAMES
from evaluator.limits import MAX_FEEDBACK_WORDS, MAX_PLAYERS
from evaluator.retrievers import MERGE_RULES, registered_retrievers
from policy.advantages import CREDIT_MODES
from policy.prompts import PROMPT_STYLES
from policy.train_config import TrainConfig
from policy.warmstart import PSEUDO_SOURCES

PINNED_PRECISIONS = ("float32", "bfloat16")
HYPOTHESIS_KINDS = ("greater", "equivalent", "two_sided")
"""The kinds of planned comparison; `app.experiments.aggregate.HYPOTHESIS_TESTS` has one test
per kind."""
UNPINNED_TRAINING = ("credit", "seed", "n_actions", "anchor", "eval_queries", "eval_every",
                     "eval_split", "eval_refuse_degenerate")  # fmt: skip
"""Training options a protocol's [training] table may not set: the cell (credit, seed), the
environment (n_actions, anchor) and the protocol's [evaluation] set them."""
MAX_SEEDS = 1000
"""The most seeds an environment may plan (and `--seeds` may name): a cell is tens of minutes."""
SEED_LIMIT = 2**31
"""Seeds are below 2^31 (an int32, what every RNG and database column takes)."""
MAX_RESAMPLES = 1_000_000
"""The most bootstrap resamples: the aggregate holds resamples × seeds × claims indices."""
CURVE_SPLITS = ("dev", "val")
"""Where a cell's learning curve is measured: settings are chosen there, never on TEST."""


# ---------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """One key of a protocol table: whether a value is good, and what it must be (the error)."""

    ok: Callable[[Any], bool]
    must: str | Callable[[], str]  # a callable: the words depend on a registry read when used
    required: bool = True

    def words(self) -> str:
        return self.must if isinstance(self.must, str) else self.must()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(low: int, high: int | None = None, *, required: bool = True) -> Rule:
    must = (
        f"must be an integer >= {low}" if high is None else f"must be an integer in {low}..{high}"
    )
    return Rule(lambda v: _is_int(v) and v >= low and (high is None or v <= high), must, required)


def number(
    low: float, high: float = math.inf, *, open_low: bool = False, open_high: bool = False,
    required: bool = True,
) -> Rule:  # fmt: skip
    """A finite number in the range (open or closed at either end)."""
    lo, hi = (">" if open_low else ">="), ("<" if open_high else "<=")
    must = f"must be a number {lo} {low:g}" + (f" and {hi} {high:g}" if math.isfinite(high) else "")

    def ok(v: Any) -> bool:
        if not _is_number(v):
            return False
        above = v > low if open_low else v >= low
        return bool(above and (v < high if open_high else v <= high))

    return Rule(ok, must, required)


def text(*, required: bool = True) -> Rule:
    return Rule(lambda v: isinstance(v, str) and bool(v.strip()), "must be a string", required)


def boolean(*, required: bool = True) -> Rule:
    return Rule(lambda v: isinstance(v, bool), "must be true or false", required)


def one_of(choices: Collection[str], *, required: bool = True, why: str = "") -> Rule:
    must = f"must be one of {', '.join(choices)}{why}"
    return Rule(lambda v: isinstance(v, str) and v in choices, must, required)


def _modes(v: Any) -> bool:
    return (
        isinstance(v, list) and bool(v) and all(isinstance(m, str) and m in CREDIT_MODES for m in v)
        and len(set(v)) == len(v)
    )  # fmt: skip


PINNED = one_of(
    PINNED_PRECISIONS, why=" (pinned, never auto: auto resolves differently per machine)"
)
START_KEYS: dict[str, Rule] = {
    "steps": integer(1), "batch_size": integer(1), "lr": number(0, open_low=True),
    "n_actions": integer(1, MAX_PLAYERS), "seed": integer(0, SEED_LIMIT - 1),
    "prompt": one_of(PROMPT_STYLES), "train_precision": PINNED,
    "policy": text(required=False), "queries": integer(1, required=False),
    "source": one_of(PSEUDO_SOURCES, required=False), "words": integer(1, 64, required=False),
    "feedback_words": integer(1, MAX_FEEDBACK_WORDS, required=False),
}  # fmt: skip
"""[start]: the warm start's recipe (`casi policy warmstart` options; ``source = "prf"`` goes
with ``prompt = "feedback"`` and ``feedback_words``, default 30)."""
EVALUATION_KEYS: dict[str, Rule] = {
    "split": one_of(SPLITS, required=False),
    "queries": Rule(lambda v: v == "all" or _is_int(v) and v >= 1, "must be 'all' or N >= 1"),
    "precision": one_of(("float32",), required=False, why=" (the held-out evaluation)"),
    "curve_split": one_of(CURVE_SPLITS, required=False, why=" (settings are chosen there, never on test)"),
    "curve_every": integer(1, required=False),
    "curve_queries": Rule(lambda v: v == "all" or _is_int(v) and v >= 1, "must be 'all' or N >= 1",
                          required=False),
    "refuse_degenerate": boolean(required=False),
}  # fmt: skip
"""[evaluation]: the held-out claims (``split`` default test); optionally a learning curve in
every cell: its policy evaluated on ``curve_split`` every ``curve_every`` steps, on
``curve_queries`` of its queries (default all). ``refuse_degenerate`` (default false): greedy
decoding with serving's degenerate guard (`policy.constrain.RowConstraints.refuse_degenerate`),
the rewrites as `POST /v1/rewrites` serves them, in the start's, the curve's and the cells'
evaluations alike."""
ENVIRONMENT_KEYS: dict[str, Rule] = {
    "retriever": Rule(lambda v: isinstance(v, str) and v in registered_retrievers(),
                      lambda: f"must be one of {', '.join(registered_retrievers())}"),
    "merge": one_of(MERGE_RULES),
    "rrf_k": number(0, required=False), "anchor": boolean(required=False),
    "n_actions": integer(1, MAX_PLAYERS),
    "modes": Rule(_modes, f"must be distinct credit modes, at least one, of {', '.join(CREDIT_MODES)}"),
    "seeds": integer(1, MAX_SEEDS), "bm25_stemmer": one_of(BM25_STEMMER_SETTINGS, required=False),
    "game": one_of(GAMES, required=False), "retrieval_k": integer(1, 1000, required=False),
    "bm25_rules": Rule(lambda v: type(v) is int and v in BM25_RULES,
                       f"must be one of {', '.join(map(str, sorted(BM25_RULES)))}", False),
}  # fmt: skip
"""[environments.<name>]: one game and its cells (``rrf_k`` default 60, ``anchor`` default true,
``bm25_stemmer`` default none, ``bm25_rules`` default 1, ``game`` default list,
``retrieval_k`` default the machine's)."""
HYPOTHESIS_KEYS: dict[str, Rule] = {
    "name": text(), "environment": text(), "a": text(), "b": text(),
    "kind": one_of(HYPOTHESIS_KINDS), "family": text(required=False),
    "metric": one_of(PER_CLAIM_METRICS, required=False),
}  # fmt: skip
"""[[hypotheses]]: one planned comparison (``family`` default primary, ``metric`` default the
analysis's)."""
ANALYSIS_KEYS: dict[str, Rule] = {
    "resamples": integer(1, MAX_RESAMPLES), "seed": integer(0),
    "alpha": number(0, 1, open_low=True, open_high=True),
    "margin": number(0, 1, open_low=True),
    "metric": one_of(PER_CLAIM_METRICS, required=False),
}  # fmt: skip
"""[analysis]: the bootstrap, α, the equivalence margin and the compared per-claim metric."""


def _option_rule(tp: Any) -> Rule:
    """The type rule of a TrainConfig option (its ranges: TrainConfig's own checks)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if tp is bool:
        return boolean(required=False)
    if tp is int:
        return Rule(_is_int, "must be an integer", False)
    if tp is float:
        return Rule(_is_number, "must be a number", False)
    if tp is str:
        return text(required=False)
    return Rule(lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                "must be a list of strings", False)  # fmt: skip


def training_keys() -> dict[str, Rule]:
    """[training]: `TrainConfig` options (less :data:`UNPINNED_TRAINING`) and ``preset``."""
    rules = {"preset": text(required=False)}
    for option in TrainConfig.options():
        if option.name not in UNPINNED_TRAINING:
            rules[option.name] = _option_rule(option.type)
    return {**rules, "precision": PINNED, "train_precision": PINNED}


# ---------------------------------------------------------------------------- reading


class Reader:
    """Checks tables of one protocol file; every error names the file and the key's path."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> NoReturn:
        raise ValueError(f"protocol {self.path}: {where}{': ' if where else ''}{problem}")

    def bad(self, where: str, key: str, value: Any, must: str) -> NoReturn:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        self.fail(f"{f'[{where}] ' if where else ''}{key} = {shown}", must)

    def table(self, parent: Mapping[str, Any], key: str, where: str = "") -> dict[str, Any]:
        if key not in parent:
            self.fail(f"[{where}]" if where else "", f"needs [{key}]")
        if not isinstance(parent[key], dict):
            self.bad(where, key, parent[key], "must be a table")
        return dict(parent[key])

    def check(self, table: Mapping[str, Any], rules: Mapping[str, Rule], where: str) -> None:
        for key, value in table.items():
            if key not in rules:
                self.bad(where, key, value, f"unknown key; known: {', '.join(rules)}")
            if not rules[key].ok(value):
                self.bad(where, key, value, rules[key].words())
        for key, rule in rules.items():
            if rule.required and key not in table:
                self.fail(f"[{where}]" if where else "", f"needs {key!r}")


def read_toml(path: Path) -> dict[str, Any]:
    try:
        text_ = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"no protocol file {path}") from None
    except OSError as exc:
        raise ValueError(f"protocol {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"protocol {path} is not UTF-8 text: {exc.reason} at byte {exc.start}"
        ) from None
    try:
        return tomllib.loads(text_)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"protocol {path} is not valid TOML: {exc}") from None
