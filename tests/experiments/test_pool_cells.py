"""The credit experiment in the pooled game (issue 37): a protocol names its dataset, its game and
its depth; a hypothesis may compare another per-claim metric (the mechanism: overlap) or test
a ≠ b two-sided; cells and start files of the pooled game hold the pool numbers, and the
aggregate shows the baselines and whether a mode wastes its budget. On the tiny format policy,
a real NFCorpus slice, real Redis and a real database."""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.experiments.aggregate import aggregate
from app.experiments.cell import cell_settings, evaluate_start, pins, run_cell
from app.experiments.protocol import load_protocol
from app.experiments.result_file import start_path
from app.experiments.start import Start, warmstart_command
from app.runtime import build_retrieval, build_scorer
from app.settings import Settings
from app.training.evaluate import build_eval_request
from app.training.policy_loader import LoadedPolicy
from evaluator.stats import two_level_bootstrap
from policy.evaluate import EvalConfig
from policy.model import policy_version
from policy.rollout import RolloutConfig

POOL_PROTOCOL = """\
name = "tiny-pool"
dataset = "{dataset}"

[start]
steps = 1
batch_size = 2
lr = 1e-4
n_actions = 2
seed = 0
prompt = "short"
train_precision = "float32"
source = "openings"
words = 6

[training]
preset = "casi"
steps = 1
queries = 2
samples = 2
lr = 1e-3
line_cap = 8
micro_batch_size = 4
prompt = "short"
precision = "float32"
train_precision = "float32"
state_every = 1

[evaluation]
split = "test"
queries = 3

[environments.pool]
game = "pool"
retriever = "bm25"
bm25_stemmer = "none"
merge = "pool"
retrieval_k = 5
anchor = true
n_actions = 2
modes = ["singleton", "shapley"]
seeds = 2

[[hypotheses]]
name = "shapley > singleton"
environment = "pool"
a = "shapley"
b = "singleton"
kind = "greater"
family = "primary"

[[hypotheses]]
name = "shapley ≠ singleton"
environment = "pool"
a = "shapley"
b = "singleton"
kind = "two_sided"
family = "secondary"

[[hypotheses]]
name = "singleton's overlap > shapley's"
environment = "pool"
a = "singleton"
b = "shapley"
kind = "greater"
family = "mechanism"
metric = "overlap"

[analysis]
metric = "pool_recall"
resamples = 500
seed = 0
alpha = 0.05
margin = 0.01
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "protocol.toml"
    path.write_text(text)
    return path


def test_a_pool_protocol_names_its_dataset_game_depth_and_metrics(
    tmp_path: Path, nf_slice: Path
) -> None:
    protocol = load_protocol(_write(tmp_path, POOL_PROTOCOL.format(dataset=nf_slice)))
    env = protocol.environment("pool")
    assert (env.game, env.merge, env.retrieval_k) == ("pool", "pool", 5)
    assert protocol.dataset == str(nf_slice) and protocol.metric == "pool_recall"
    assert protocol.metrics == ("pool_recall", "overlap")  # each cell file must hold both
    kinds = {h.name: (h.kind, protocol.metric_of(h)) for h in protocol.hypotheses}
    assert kinds["shapley ≠ singleton"] == ("two_sided", "pool_recall")
    assert kinds["singleton's overlap > shapley's"] == ("greater", "overlap")
    # the cells run in the protocol's game, depth and dataset, whatever this machine says
    s = cell_settings(Settings(), protocol, env)
    assert (s.game, s.merge, s.retrieval_k, s.dataset) == ("pool", "pool", 5, nf_slice)
    assert s.bm25_rules == 1  # the protocol names no rules: the ones its cells were made with
    assert warmstart_command(protocol.start, protocol.dataset).startswith(
        f"CASI_DATASET={nf_slice} casi policy warmstart --batch-size 2"
    )
    assert "--source openings" in warmstart_command(protocol.start)


@pytest.mark.parametrize(
    ("old", "new", "fragment"),
    [
        ('merge = "pool"', 'merge = "rrf"', "game"),  # the pooled game pools, nothing else
        ('game = "pool"', 'game = "auction"', "game"),
        ('metric = "overlap"', 'metric = "precision"', "metric"),
        ('kind = "two_sided"', 'kind = "less"', "kind"),
        ('source = "openings"', 'source = "abstracts"', "source"),
        ("retrieval_k = 5", "retrieval_k = 0", "retrieval_k"),
    ],
)
def test_a_pool_protocol_refuses_what_cannot_run(
    tmp_path: Path, old: str, new: str, fragment: str
) -> None:
    text = POOL_PROTOCOL.format(dataset="data/nfcorpus")
    assert old in text
    with pytest.raises(ValueError, match=fragment):
        load_protocol(_write(tmp_path, text.replace(old, new, 1)))


def tiny_start(format_policy: Any, smol_tokenizer: Any, protocol: Any) -> tuple[Any, ...]:
    """The tiny policy as a protocol's start: (its model, a copy of ``format_policy``; the
    loaded policy; its weights, to restore; the `Start`)."""
    model = copy.deepcopy(format_policy)
    pol = LoadedPolicy(
        model, smol_tokenizer, policy_version(model), "format", "tiny", "tiny", "base"
    )
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return model, pol, weights, Start(pol.version, "recipe-tiny", dict(protocol.start))


@pytest.fixture
def pool_units(format_policy, smol_tokenizer, nf_slice, db_url, tmp_path):  # type: ignore[no-untyped-def]
    """Everything `run_cell` needs in the pooled game, on the tiny policy and the NFCorpus
    slice; ``cell(mode, seed)`` runs one into ``tmp_path``."""
    upgrade_to_head(db_url)
    factory = make_session_factory(make_engine(db_url))
    protocol = load_protocol(_write(tmp_path, POOL_PROTOCOL.format(dataset=nf_slice)))
    env = protocol.environment("pool")
    settings = cell_settings(Settings(var_dir=tmp_path / "var"), protocol, env)
    r = build_retrieval(settings, retriever=env.retriever)
    scorer = build_scorer("replay", settings, r, split="train")
    model, pol, weights, start = tiny_start(format_policy, smol_tokenizer, protocol)
    rollout = RolloutConfig(n_actions=2, line_cap=8, prompt="short")
    request = build_eval_request(r, "test", 3, EvalConfig(rollout))
    pin = pins(protocol, env, start, r, settings)

    def cell(mode: str, seed: int) -> Path:
        return run_cell(
            factory, settings.var_dir, tmp_path, protocol, env, mode, seed, retrieval=r,
            scorer=scorer, policy=pol, start=start, request=request, pin=pin,
            list_k=settings.list_k, restore=lambda: model.load_state_dict(weights),
        )[0]  # fmt: skip

    def start_eval() -> Path:
        model.load_state_dict(weights)
        return evaluate_start(factory, tmp_path, protocol, env, start, pol, request, pin)

    return {"cell": cell, "start_eval": start_eval, "protocol": protocol, "start": start,
            "pin": pin, "tmp": tmp_path}  # fmt: skip


@pytest.mark.integration
def test_pool_cells_and_their_aggregate(pool_units) -> None:  # type: ignore[no-untyped-def]
    tmp = pool_units["tmp"]
    pin = pool_units["pin"]
    assert pin["game"] == "pool" and pin["retrieval_k"] == 5
    assert pin["dataset_checksum"] and pin["cpu_family"]
    pool_units["start_eval"]()
    paths = {(m, s): pool_units["cell"](m, s) for s in (0, 1) for m in ("singleton", "shapley")}

    started = json.loads(start_path(tmp, "pool", pool_units["start"].version).read_text())
    cells = {k: json.loads(p.read_text()) for k, p in paths.items()}
    for data in [started, *cells.values()]:
        for key in ("pool_recall", "query_pool_recall", "budget_recall", "prf_recall",
                    "prf_ndcg@10", "overlap"):  # fmt: skip
            assert len(data[key]) == 3 and all(0.0 <= x <= 1.0 for x in data[key])
        # the pool holds the query's own list: never below it, and the deeper list of the
        # same query holds the shallower one
        for pool, own, deep in zip(
            data["pool_recall"], data["query_pool_recall"], data["budget_recall"], strict=True
        ):
            assert own - 1e-12 <= pool and own - 1e-12 <= deep

    result = aggregate(tmp)
    table = (tmp / "table.md").read_text()
    summary = result["environments"]["pool"]["modes"]
    for mode in ("singleton", "shapley"):
        vals = [statistics.fmean(cells[mode, s]["pool_recall"]) for s in (0, 1)]
        assert summary[mode]["pool_recall"] == pytest.approx(
            (statistics.fmean(vals), statistics.stdev(vals))
        )
        # the served list is the pool re-ranked (served_ndcg@10), not the fused head (ndcg@10)
        assert summary[mode]["secondary"] == ["served_ndcg@10", "overlap", "recall@100"]
        served = statistics.fmean(
            statistics.fmean(cells[mode, s]["served_ndcg@10"]) for s in (0, 1)
        )
        assert summary[mode]["served_ndcg@10"][0] == pytest.approx(served)
    # the baselines come from the start file; the verdict line compares each mode with the budget
    budget = statistics.fmean(started["budget_recall"])
    assert f"equal budget: the query alone, depth (m + 1)·k | {budget:.4f} |" in table
    prf = statistics.fmean(started["prf_recall"])
    prf_served = statistics.fmean(started["prf_served_ndcg@10"])
    assert f"keyword expansion (PRF keywords, m rewrites) | {prf:.4f} | {prf_served:.4f} |" in table
    d = summary["shapley"]["pool_recall"][0] - budget
    assert f"Against the equal budget ({budget:.4f}): " in table and f"shapley {d:+.4f}" in table
    assert ("shapley " + f"{d:+.4f} (wastes its budget)" in table) == (d <= 0)

    rows = {r["name"]: r for r in result["hypotheses"]}
    a = np.array([cells["shapley", s]["pool_recall"] for s in (0, 1)])
    b = np.array([cells["singleton", s]["pool_recall"] for s in (0, 1)])
    boot = two_level_bootstrap(a, b, n_resamples=500, seed=0, level=0.95)
    assert rows["shapley > singleton"]["p"] == boot.p_one_sided
    two = rows["shapley ≠ singleton"]
    assert two["metric"] == "pool_recall"
    assert two["p"] == pytest.approx(min(1.0, 2 * min(boot.p_one_sided, 1 - boot.p_one_sided)))
    mech = rows["singleton's overlap > shapley's"]
    assert mech["metric"] == "overlap"
    d_overlap = [
        statistics.fmean(cells["singleton", s]["overlap"])
        - statistics.fmean(cells["shapley", s]["overlap"])
        for s in (0, 1)
    ]
    assert mech["per_seed_diff"] == pytest.approx(d_overlap)
    assert "| singleton > shapley (overlap between the rewrites' lists) | mechanism |" in table

    # a cell without a compared metric is refused, naming it
    broken: dict[str, Any] = dict(cells["shapley", 1])
    broken.pop("overlap")
    paths["shapley", 1].write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="'overlap'"):
        aggregate(tmp)
