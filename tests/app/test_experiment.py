"""`casi experiment credit` on the tiny format policy and the SciFact slice, real Redis and real
databases: an experiment interrupted inside its second cell and run again skips the finished
cell, resumes the interrupted one, and ends with the same held-out curves as an uninterrupted
experiment; the table, the by-step table, the plot and the JSON are written."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.services.evaluate import build_eval_request
from app.services.experiment import make_plan, run_experiment
from app.services.policy_loader import LoadedPolicy
from evaluator.scorers import make_scorer
from policy.evaluate import EvalConfig
from policy.model import policy_version
from policy.train_config import TrainConfig

MODES = ["broadcast", "shapley"]
META = {"policy": None, "evaluator": "replay", "max_docs": None}


class Killed(Exception):
    """Stands in for a kill between two steps of a cell."""


@pytest.mark.integration
def test_interrupted_experiment_resumes_to_the_same_results(
    format_policy, smol_tokenizer, slice_retrieval, db_url, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    factory = make_session_factory(engine)
    cfg = TrainConfig.from_preset(
        "casi", steps=2, queries=2, samples=3, n_actions=2, line_cap=10, lr=1e-3,
        eval_every=1, eval_queries=3, micro_batch_size=4,
    )  # fmt: skip
    model = copy.deepcopy(format_policy)
    pol = LoadedPolicy(
        model, smol_tokenizer, policy_version(model), "format", "tiny", "tiny", "base"
    )
    start = {k: v.clone() for k, v in model.state_dict().items()}
    request = build_eval_request(
        slice_retrieval, "test", 3, EvalConfig(n_actions=2, line_cap=10)
    )
    scorer = make_scorer("replay", qrels=slice_retrieval.dataset.qrels_rows("train"), k=10)

    def build() -> tuple[Any, ...]:
        model.load_state_dict(start)  # what a fresh process would load
        return slice_retrieval, scorer, pol, request, lambda: model.load_state_dict(start)

    var = tmp_path / "var"
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full = run_experiment(
        factory, var, full_dir, make_plan(full_dir, "full", MODES, [0], cfg, META), build
    )

    seen: list[tuple[str, int]] = []

    def kill_in_second_cell(result: Any) -> None:
        seen.append((plan.cells[len(seen) // 2].mode, result.step))
        if len(seen) == 3:  # broadcast steps 1, 2 done; shapley step 1 recorded
            raise Killed

    plan = make_plan(cut_dir, "cut", MODES, [0], cfg, META)
    with pytest.raises(Killed):
        run_experiment(factory, var, cut_dir, plan, build, on_step=kill_in_second_cell)
    stored = make_plan(cut_dir, "cut", MODES, [0], cfg, META)  # a new process reads the plan
    assert [c.done for c in stored.cells] == [True, False] and stored.cells[1].run_id is not None
    assert not (cut_dir / "results.json").exists()

    resumed: list[int] = []
    cut = run_experiment(
        factory, var, cut_dir, stored, build, on_step=lambda r: resumed.append(r.step)
    )
    assert resumed == [2]  # the finished cell is skipped; the interrupted one continues
    assert cut["start"] == full["start"]
    assert cut["curves"] == full["curves"]  # the same held-out numbers, step by step
    assert set(cut["curves"]["shapley/seed0"]) == {"0", "1", "2"}
    assert cut["final"] == full["final"] and set(cut["final"]) == set(MODES)

    table = (cut_dir / "table.md").read_text()
    for mode in MODES:
        row = next(line for line in table.splitlines() if line.startswith(f"| {mode} |"))
        assert "±" in row and "not run" not in row
    assert "| credit | start | step 1 | step 2 |" in table
    assert (cut_dir / "ndcg.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((cut_dir / "results.json").read_text())["modes"] == MODES
    with pytest.raises(ValueError, match="use another --name"):
        make_plan(cut_dir, "cut", ["singleton"], [0], cfg, META)
    engine.dispose()
