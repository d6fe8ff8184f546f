"""Issue 38, item 7: every value of a credit-experiment protocol is checked when it is read, and
each bad one is ONE line naming the file and the key's path. Before, `retriever = "foo"`,
`merge = "bogus"`, `split = "bogus"`, `resamples = 0`, `alpha = 2.0` and `margin = -1.0` were
accepted; `rrf_k = [1]` and `hypotheses = [1, 2]` crashed (TypeError, AttributeError: "this is
a bug"); `rrf_k = "abc"` was a bare float() error and a non-UTF-8 file a decode error without
the file's name. Item 2's `[analysis] metric`: a key the committed protocol does not write
keeps its hash."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.experiments.aggregate import HYPOTHESIS_TESTS
from app.experiments.protocol import load_protocol
from app.experiments.protocol_keys import HYPOTHESIS_KINDS
from app.experiments.result_file import DEFAULT_METRIC, PER_CLAIM_METRICS
from app.training.splits import SPLITS
from evaluator.retrievers import MERGE_RULES, registered_retrievers
from policy.advantages import CREDIT_MODES
from policy.prompts import PROMPT_STYLES

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "experiments" / "credit-units" / "protocol.toml"
COMMITTED_HASH = "4989879de0859789"  # in every committed result file and in table.md
TEXT = COMMITTED.read_text(encoding="utf-8")


def _edit(old: str, new: str) -> str:
    assert TEXT.count(old) >= 1, old
    return TEXT.replace(old, new, 1)


def _without_hypotheses(head: str) -> str:
    """The committed protocol with every [[hypotheses]] table replaced by ``head`` (top level)."""
    body = re.sub(r"\[\[hypotheses\]\].*?(?=\[analysis\])", "", TEXT, flags=re.S)
    return head + "\n" + body


CASES = {
    "retriever foo": (
        _edit('retriever = "bm25"', 'retriever = "foo"'),
        "[environments.main] retriever = 'foo': must be one of "
        + ", ".join(registered_retrievers()),
    ),
    "merge bogus": (
        _edit('merge = "rrf"', 'merge = "bogus"'),
        f"[environments.main] merge = 'bogus': must be one of {', '.join(MERGE_RULES)}",
    ),
    "split bogus": (
        _edit('split = "test"', 'split = "bogus"'),
        f"[evaluation] split = 'bogus': must be one of {', '.join(SPLITS)}",
    ),
    "resamples 0": (
        _edit("resamples = 10000", "resamples = 0"),
        "[analysis] resamples = 0: must be an integer in 1..1000000",
    ),
    "alpha 2": (
        _edit("alpha = 0.05", "alpha = 2.0"),
        "[analysis] alpha = 2.0: must be a number > 0 and < 1",
    ),
    "margin -1": (
        _edit("margin = 0.005", "margin = -1.0"),
        "[analysis] margin = -1.0: must be a number > 0 and <= 1",
    ),
    "rrf_k a list": (
        _edit("rrf_k = 60.0", "rrf_k = [1]"),
        "[environments.main] rrf_k = [1]: must be a number >= 0",
    ),
    "rrf_k a string": (
        _edit("rrf_k = 60.0", 'rrf_k = "abc"'),
        "[environments.main] rrf_k = 'abc': must be a number >= 0",
    ),
    "rrf_k nan": (
        _edit("rrf_k = 60.0", "rrf_k = nan"),
        "[environments.main] rrf_k = nan: must be a number >= 0",
    ),
    "hypotheses not tables": (
        _without_hypotheses("hypotheses = [1, 2]"),
        "hypotheses[0] = 1: must be a table with name, environment, a, b, kind, family, metric",
    ),
    "hypotheses not an array": (
        _without_hypotheses('hypotheses = "all"'),
        "hypotheses = 'all': must be an array of tables ([[hypotheses]])",
    ),
    "hypothesis kind": (
        _edit('kind = "greater"', 'kind = "bogus"'),
        f"[hypotheses[0]] kind = 'bogus': must be one of {', '.join(HYPOTHESIS_KINDS)}",
    ),
    "hypothesis family": (
        _edit('family = "primary"', "family = 3"),
        "[hypotheses[0]] family = 3: must be a string",
    ),
    "hypothesis without kind": (
        _edit('kind = "greater"\n', ""),
        "[hypotheses[0]]: needs 'kind'",
    ),
    "hypothesis unknown key": (
        _edit('kind = "greater"', 'kind = "greater"\nkidn = "x"'),
        "[hypotheses[0]] kidn = 'x': unknown key; known: name, environment, a, b, kind, family, metric",
    ),
    "hypothesis environment": (
        _edit('environment = "main"', 'environment = "mian"'),
        "[hypotheses[0]] environment = 'mian': must be one of main, control",
    ),
    "hypothesis a mode of another environment": (
        _edit('a = "shapley"\nb = "singleton"\nkind = "equivalent"', 'a = "shuffled"\nb = "singleton"\nkind = "equivalent"'),
        "[hypotheses[4]] a = 'shuffled': not in its environment's modes (broadcast, singleton, shapley)",
    ),  # fmt: skip
    "hypothesis a = b": (
        _edit('b = "broadcast"', 'b = "shapley"'),
        "[hypotheses[0]] b = 'shapley': must differ from a",
    ),
    "hypothesis names twice": (
        _edit('name = "shapley > singleton"', 'name = "shapley > broadcast"'),
        "[hypotheses[1]] name = 'shapley > broadcast': is the name of another hypothesis",
    ),
    "modes": (
        _edit('modes = ["broadcast", "singleton", "shapley"]', 'modes = ["broadcast", "fancy"]'),
        "[environments.control] modes = ['broadcast', 'fancy']: must be distinct credit modes, "
        f"at least one, of {', '.join(CREDIT_MODES)}",
    ),
    "modes repeated": (
        _edit('modes = ["broadcast", "singleton", "shapley"]', 'modes = ["shapley", "shapley"]'),
        "[environments.control] modes = ['shapley', 'shapley']: must be distinct credit modes, "
        f"at least one, of {', '.join(CREDIT_MODES)}",
    ),
    "seeds 0": (_edit("seeds = 6", "seeds = 0"), "[environments.main] seeds = 0: must be an integer in 1..1000"),
    "seeds float": (_edit("seeds = 6", "seeds = 6.0"), "[environments.main] seeds = 6.0: must be an integer in 1..1000"),
    "seeds bool": (_edit("seeds = 6", "seeds = true"), "[environments.main] seeds = True: must be an integer in 1..1000"),
    "n_actions": (_edit("n_actions = 4\nmodes", "n_actions = 13\nmodes"), "[environments.main] n_actions = 13: must be an integer in 1..12"),
    "anchor": (_edit("anchor = true", 'anchor = "yes"'), "[environments.main] anchor = 'yes': must be true or false"),
    "environment typo": (
        _edit('merge = "rrf"', 'mrege = "rrf"'),
        "[environments.main] mrege = 'rrf': unknown key; known: retriever, merge, rrf_k, anchor, "
        "n_actions, modes, seeds, bm25_stemmer, game, retrieval_k, bm25_rules",
    ),
    "environment without merge": (_edit('merge = "rrf"\n', ""), "[environments.main]: needs 'merge'"),
    "environment a folder name": (_edit("[environments.main]", '[environments."../main"]'), "[environments.../main]: an environment's name must be a folder name (letters, digits, _ . -)"),
    "environment not a table": (_edit("[environments.control]", "[environments]\ncontrol = 3\n[environments.ctl]"), "[environments] control = 3: must be a table"),
    "bm25_stemmer": (_edit("[environments.main]", '[environments.main]\nbm25_stemmer = "porter"'), "[environments.main] bm25_stemmer = 'porter': must be one of none, english"),
    "bm25_rules": (_edit("[environments.main]", '[environments.main]\nbm25_rules = "2"'), "[environments.main] bm25_rules = '2': must be one of 1, 2"),
    "bm25_rules 3": (_edit("[environments.main]", "[environments.main]\nbm25_rules = 3"), "[environments.main] bm25_rules = 3: must be one of 1, 2"),
    "max_docs": (_edit("max_docs = 5183", "max_docs = 0"), "max_docs = 0: must be an integer >= 1"),
    "no name": (_edit('name = "credit-units-v1"\n', ""), "needs 'name'"),
    "unknown top-level key": (_edit("max_docs = 5183", "max_docs = 5183\nmax_doc = 5"), "max_doc = 5: unknown key; known: name, max_docs, dataset, start, training, evaluation, environments, hypotheses, analysis"),
    "no [analysis]": (TEXT[: TEXT.index("[analysis]")], "needs [analysis]"),
    "start not a table": (re.sub(r"\[start\].*?(?=\[training\])", "", TEXT, flags=re.S).replace('max_docs', 'start = 3\nmax_docs', 1), "start = 3: must be a table"),
    "start prompt": (_edit('prompt = "short"', 'prompt = "long"'), f"[start] prompt = 'long': must be one of {', '.join(PROMPT_STYLES)}"),
    "start lr": (_edit("lr = 5e-5", "lr = 0"), "[start] lr = 0: must be a number > 0"),
    "start precision auto": (
        _edit('seed = 0\nprompt = "short"\ntrain_precision = "float32"', 'seed = 0\nprompt = "short"\ntrain_precision = "auto"'),
        "[start] train_precision = 'auto': must be one of float32, bfloat16 (pinned, never auto: "
        "auto resolves differently per machine)",
    ),
    "training lr a string": (_edit("lr = 1e-4", 'lr = "abc"'), "[training] lr = 'abc': must be a number"),
    "training lr negative": (
        _edit("lr = 1e-4", "lr = -1.0"),
        "[training] with [environments.main], mode broadcast: lr and weight_decay must be >= 0",
    ),
    "training steps a float": (_edit("steps = 24", "steps = 2.5"), "[training] steps = 2.5: must be an integer"),
    "training sets a cell's seed": (
        _edit("state_every = 4", "state_every = 4\nseed = 3"),
        "[training] seed = 3: may not be set here (cells set credit and seed, environments "
        "n_actions and anchor, [evaluation] the held-out evaluation)",
    ),
    "training sets the held-out guard": (
        _edit("state_every = 4", "state_every = 4\neval_refuse_degenerate = true"),
        "[training] eval_refuse_degenerate = True: may not be set here (cells set credit and "
        "seed, environments n_actions and anchor, [evaluation] the held-out evaluation)",
    ),
    "training unknown option": (_edit("state_every = 4", "state_every = 4\nstat_every = 4"), "[training] stat_every = 4: unknown key; known: "),
    "evaluation queries": (_edit('queries = "all"', 'queries = "some"'), "[evaluation] queries = 'some': must be 'all' or N >= 1"),
    "evaluation precision": (_edit('queries = "all"', 'queries = "all"\nprecision = "bfloat16"'), "[evaluation] precision = 'bfloat16': must be one of float32 (the held-out evaluation)"),
    "metric": (
        _edit("margin = 0.005", 'margin = 0.005\nmetric = "bogus"'),
        f"[analysis] metric = 'bogus': must be one of {', '.join(PER_CLAIM_METRICS)}",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_protocol_value_is_one_line_with_its_path(case: str, tmp_path: Path) -> None:
    text, where = CASES[case]
    path = tmp_path / "protocol.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_protocol(path)
    message = str(info.value)
    assert "\n" not in message
    if where.endswith("known: "):  # the list of TrainConfig options is long: its start
        assert message.startswith(f"protocol {path}: {where}"), message
    else:
        assert message == f"protocol {path}: {where}"


def test_a_protocol_that_is_not_utf8_names_its_file(tmp_path: Path) -> None:
    path = tmp_path / "protocol.toml"
    raw = TEXT.encode().replace(b"credit-units-v1", b"credit-units-\xe9")
    path.write_bytes(raw)
    with pytest.raises(ValueError) as info:
        load_protocol(path)
    at = raw.index(b"\xe9")
    assert (
        str(info.value)
        == f"protocol {path} is not UTF-8 text: invalid continuation byte at byte {at}"
    )


def test_the_committed_protocol_keeps_its_hash_and_compares_ndcg() -> None:
    protocol = load_protocol(COMMITTED)
    assert protocol.hash == COMMITTED_HASH
    assert "metric" not in protocol.raw["analysis"] and protocol.metric == DEFAULT_METRIC
    assert DEFAULT_METRIC == "ndcg@10"


def test_the_metric_key_names_the_compared_metric(tmp_path: Path) -> None:
    path = tmp_path / "protocol.toml"
    path.write_text(_edit("margin = 0.005", 'margin = 0.005\nmetric = "recall@100"'))
    protocol = load_protocol(path)
    assert protocol.metric == "recall@100" and protocol.hash != COMMITTED_HASH


def test_every_hypothesis_kind_has_its_test() -> None:
    assert set(HYPOTHESIS_TESTS) == set(HYPOTHESIS_KINDS)
