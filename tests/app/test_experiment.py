"""`casi experiment credit` on the tiny format policy and the SciFact slice, real Redis and real
databases: an experiment interrupted inside its second cell and run again skips the finished
cell, resumes the interrupted one, and ends with the same held-out curves (and per-claim rows)
as an uninterrupted experiment; the tables (means, per seed, paired test, compute, by step),
the plot and the JSON are written. `casi eval`, `casi train`'s step-0 evaluation and the
experiment's start evaluation are one path: the same numbers for one version, whatever the
training sampler's precision. A 2-step experiment runs in the (bm25, rrf, m = 8) game."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.cli.experiment import count_eval_queries, environment_settings
from app.db import repositories as repo
from app.db import session_scope
from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.runtime import Retrieval
from app.settings import Settings
from app.training.evaluate import build_eval_request, evaluate_and_store, held_out_request
from app.training.experiment import run_experiment
from app.training.experiment_plan import game_pins, load_per_query, make_plan, pin_game
from app.training.policy_loader import LoadedPolicy
from app.training.runs import open_run
from app.training.train import run_training
from evaluator.actions import ActionExecutor
from evaluator.cache import ActionCache
from evaluator.retrievers import RetrieverSpec, build_retriever
from evaluator.scorers import make_scorer
from policy.evaluate import EvalConfig
from policy.model import policy_version
from policy.rollout import RolloutConfig
from policy.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
MODES = ["broadcast", "shapley"]
META = {"policy": None, "evaluator": "replay", "max_docs": None}
BM25_META = {**META, "retriever": "bm25", "merge": "rrf", "rrf_k": 60.0}


class Killed(Exception):
    """Stands in for a kill between two steps of a cell."""


@pytest.mark.integration
def test_interrupted_experiment_resumes_to_the_same_results(
    format_policy, smol_tokenizer, slice_retrieval, train_scorer, db_url, tmp_path
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
        slice_retrieval, "test", 3, EvalConfig(RolloutConfig(n_actions=2, line_cap=10))
    )

    def build() -> tuple[Any, ...]:
        model.load_state_dict(start)  # what a fresh process would load
        return slice_retrieval, train_scorer, pol, request, lambda: model.load_state_dict(start)

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
    stored_json = json.loads((cut_dir / "results.json").read_text())
    assert stored_json["modes"] == MODES
    assert cut["per_claim"] == full["per_claim"]  # the resumed cell's per-claim rows too
    claims = cut["per_claim"]
    assert len(claims["claim_ids"]) == 3 and set(claims["runs"]) == {
        "broadcast/seed0",
        "shapley/seed0",
    }
    assert all(len(v["combined_ndcg@10"]) == 3 for v in claims["runs"].values())
    assert set(load_per_query(cut_dir, "shapley-s0")) == {1, 2}  # every evaluated step, once
    pairs = {(p["a"], p["b"]): p for p in cut["significance"]["pairs"]}
    assert set(pairs) == {("broadcast", "shapley"), ("shapley", "broadcast")}
    assert pairs["shapley", "broadcast"]["n_resamples"] == 10_000
    assert pairs["shapley", "broadcast"]["mean_diff"] == pytest.approx(
        -pairs["broadcast", "shapley"]["mean_diff"]
    )
    assert cut["significance"]["complete"] and cut["significance"]["step"] == 2
    assert set(cut["per_seed"]) == {"broadcast/seed0", "shapley/seed0"}
    # equal compute across modes: the same steps and rollouts per step
    assert (
        cut["compute"]["broadcast"]["rollouts"]
        == cut["compute"]["shapley"]["rollouts"]
        == 2 * 2 * 3
    )
    assert cut["machine"]["cpu_model"] and "isa_flags" in cut["machine"]
    assert "Per seed" in table and "Paired test over 3 held-out claims" in table
    assert "| broadcast | 1 vs 1 |" in table and "Machine:" in table
    with pytest.raises(ValueError, match="use another --name"):
        make_plan(cut_dir, "cut", ["singleton"], [0], cfg, META)
    engine.dispose()


def test_a_resumed_plan_must_ask_for_the_same_experiment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = TrainConfig.from_preset("casi", steps=2, n_actions=2)
    make_plan(tmp_path, "x", MODES, [0], cfg, BM25_META)
    assert make_plan(tmp_path, "x", MODES, [0], cfg, BM25_META).meta["merge"] == "rrf"
    with pytest.raises(ValueError, match=r"other settings \(retriever, merge\)"):
        make_plan(tmp_path, "x", MODES, [0], cfg, {**META, "retriever": "dense", "merge": "max"})
    with pytest.raises(ValueError, match=r"other settings \(steps\)"):
        make_plan(
            tmp_path,
            "x",
            MODES,
            [0],
            TrainConfig.from_preset("casi", steps=3, n_actions=2),
            BM25_META,
        )
    with pytest.raises(ValueError, match=r"other settings \(lr, top_layers\)"):  # by option name
        changed = TrainConfig.from_preset("casi", steps=2, n_actions=2, lr=1e-3, top_layers=3)
        make_plan(tmp_path, "x", MODES, [0], changed, BM25_META)


def test_a_resumed_experiment_must_score_in_the_same_game(
    slice_path, slice_retrieval, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A plain experiment pins the game its cells are scored in at its first start: resumed
    with another CASI_GAME, CASI_RETRIEVAL_K or another dataset (the settings are read afresh on
    every run), it had trained the rest of its cells in that game and tabled them beside the
    first ones. A plan stored before games were pinned is pinned at its next start."""
    settings = Settings(dataset=slice_path, var_dir=tmp_path)
    cfg = TrainConfig.from_preset("casi", steps=2, n_actions=2)
    plan = make_plan(tmp_path / "x", "x", MODES, [0], cfg, META)
    pins = game_pins(slice_retrieval, settings)
    assert pins["game"] == "list" and pins["index_version"] == slice_retrieval.index.version
    pin_game(plan, pins)
    assert plan.meta["game_pins"] == pins
    pin_game(plan, game_pins(slice_retrieval, settings))  # the same game: resumes
    pool = settings.model_copy(update={"game": "pool", "retrieval_k": 25})
    with pytest.raises(ValueError) as info:
        pin_game(plan, game_pins(slice_retrieval, pool))
    assert str(info.value).startswith(
        "experiment 'x' started in another game (game list → pool; retrieval_k 10 → 25): rerun"
    )
    other = tmp_path / "other-slice"
    shutil.copytree(slice_path, other)
    with (other / "queries.jsonl").open("a", encoding="utf-8") as fh:
        fh.write("\n")  # one more byte: another dataset
    with pytest.raises(ValueError, match=r"dataset_checksum [0-9a-f]{16} → [0-9a-f]{16}"):
        pin_game(plan, game_pins(slice_retrieval, settings.model_copy(update={"dataset": other})))


HOLD_LOCK = """
import sys, time
from pathlib import Path
from evaluator.locks import lock_if_free
with lock_if_free(Path(sys.argv[1]), record_holder=True) as free:
    print("held" if free else "busy", flush=True)
    time.sleep(60)
"""


def test_an_experiment_is_run_by_one_process_at_a_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two `casi experiment credit --name x` at once both resumed the same cell's run (one
    state, one metrics.jsonl, one per-query file): the plan had no lock. The second is refused
    before it builds anything, naming the holder."""
    cfg = TrainConfig.from_preset("casi", steps=2, n_actions=2)
    plan = make_plan(tmp_path, "x", MODES, [0], cfg, BM25_META)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "plan.json")],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"

        def build() -> Any:
            raise AssertionError("built while another process runs the experiment")

        with pytest.raises(ValueError) as info:
            run_experiment(None, tmp_path / "var", tmp_path, plan, build)  # type: ignore[arg-type]
        assert str(info.value) == (
            f"experiment 'x' is being run by another casi process (pid {holder.pid}): let it "
            "finish, or stop it and run this again to resume"
        )
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_cli_environment_and_eval_queries(slice_path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(dataset=slice_path, var_dir=tmp_path)
    assert environment_settings(settings, "bm25", "auto", None)[1] == {
        "retriever": "bm25",
        "merge": "rrf",
        "rrf_k": 60.0,
    }
    env, resolved = environment_settings(settings, "dense", "rrf", 10)
    assert resolved["merge"] == "rrf" and env.rrf_k == 10 and env.retriever == "dense"
    assert environment_settings(settings, "dense", None, None)[1]["merge"] == "max"
    with pytest.raises(ValueError, match="unknown merge"):
        environment_settings(settings, "dense", "min", None)
    assert count_eval_queries(settings, "test", "all") == 8  # the slice's whole TEST split
    assert count_eval_queries(settings, "test", "5") == 5
    with pytest.raises(ValueError, match="a number or 'all'"):
        count_eval_queries(settings, "test", "most")


def _tiny(format_policy, smol_tokenizer) -> tuple[Any, LoadedPolicy]:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(format_policy)
    return model, LoadedPolicy(
        model, smol_tokenizer, policy_version(model), "format", "tiny", "tiny", "base"
    )


def test_eval_train_and_experiment_start_are_one_path(
    format_policy, smol_tokenizer, slice_retrieval, train_scorer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """For one version: `casi eval`'s evaluation, `casi train`'s step-0 evaluation (sampler in
    bfloat16) and the experiment's start evaluation give identical numbers, claim by claim."""
    db_url = f"sqlite:///{(tmp_path / 'casi.db').as_posix()}"
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    factory = make_session_factory(engine)
    model, pol = _tiny(format_policy, smol_tokenizer)

    # casi eval: TrainConfig from its options → the shared request → evaluate_and_store
    eval_cfg = RolloutConfig(n_actions=2, prompt="short", line_cap=10)
    with session_scope(factory) as session:
        pv_id = repo.get_or_add_policy_version(
            session, version=pol.version, name=pol.name, base_model=pol.base_model,
            path=pol.path, kind=pol.kind,
        ).id  # fmt: skip
    request = held_out_request(slice_retrieval, eval_cfg, "test", 3)
    by_eval = evaluate_and_store(factory, model, smol_tokenizer, request, policy_version_id=pv_id)

    # casi train: step-0 evaluation of a run whose sampler is bfloat16
    cfg = TrainConfig.from_preset(
        "casi", steps=1, queries=2, samples=2, n_actions=2, line_cap=10, prompt="short",
        eval_queries=3, eval_every=1, precision="bfloat16", micro_batch_size=4,
    )  # fmt: skip
    seen: dict[int, Any] = {}
    handle = open_run(factory, tmp_path / "var", cfg, pol, "one-path", META)
    run_training(
        factory, slice_retrieval, train_scorer, pol, cfg, handle,
        held_out_request(slice_retrieval, cfg.rollout, cfg.eval.split, cfg.eval.queries),
        on_eval=lambda step, result: seen.setdefault(step, result),
    )  # fmt: skip
    by_train = seen[0]

    # the experiment's start evaluation (its cells are marked done: only the start runs)
    model.load_state_dict(format_policy.state_dict())
    folder = tmp_path / "exp"
    plan = make_plan(folder, "one-path", MODES, [0], cfg, META)
    for cell in plan.cells:
        cell.done = True
    run_experiment(
        factory, tmp_path / "var", folder, plan,
        lambda: (slice_retrieval, train_scorer, pol, held_out_request(slice_retrieval, cfg.rollout, "test", 3), lambda: None),
    )  # fmt: skip
    assert by_eval.metrics == by_train.metrics == plan.start_eval
    start_rows = load_per_query(folder, "start")[0]
    assert by_eval.per_query == by_train.per_query == start_rows
    with session_scope(factory) as session:
        stored = [e for e in repo.evaluations_for_policy(session, pv_id) if not e.step]
        assert len(stored) == 3  # all three stored against the version, with the machine
        assert len({json.dumps(e.metrics, sort_keys=True) for e in stored}) == 1
        assert all(
            e.config["precision"] == "float32" and e.config["machine"]["cpu_model"] for e in stored
        )
    engine.dispose()


@pytest.fixture()
def bm25_slice_retrieval(slice_dataset, embedder, var_dir, redis_client) -> Retrieval:  # type: ignore[no-untyped-def]
    """The slice's retrieval stack with bm25 actions and the rrf merge (its default)."""
    index, _ = build_retriever("bm25", RetrieverSpec(slice_dataset.documents, var_dir))
    cache = ActionCache(redis_client, index.version, index.encoder_version, 10)
    ex = ActionExecutor(embedder, index, cache)
    assert ex.merge == "rrf"
    return Retrieval(slice_dataset, embedder, index, cache, ex, False, redis_client)  # type: ignore[arg-type]


def test_two_step_experiment_bm25_rrf_eight_actions(
    format_policy, smol_tokenizer, bm25_slice_retrieval, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """`casi experiment credit --retriever bm25 --merge rrf --n-actions 8 --steps 2` (service
    level): 256-coalition games, every mode × seed trained and evaluated, the paired test."""
    r = bm25_slice_retrieval
    db_url = f"sqlite:///{(tmp_path / 'casi.db').as_posix()}"
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    factory = make_session_factory(engine)
    model, pol = _tiny(format_policy, smol_tokenizer)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = TrainConfig.from_preset(
        "casi", steps=2, queries=2, samples=2, n_actions=8, line_cap=3, lr=1e-3,
        eval_every=0, eval_queries=8, micro_batch_size=4, prompt="short",
    )  # fmt: skip
    scorer = make_scorer("replay", qrels=r.dataset.qrels_rows("train"), k=10)
    request = held_out_request(r, cfg.rollout, "test", cfg.eval.queries)
    steps: list[Any] = []

    def build() -> tuple[Any, ...]:
        return r, scorer, pol, request, lambda: model.load_state_dict(start)

    folder = tmp_path / "bm25"
    plan = make_plan(folder, "bm25", MODES, [0, 1], cfg, BM25_META)
    out = run_experiment(factory, tmp_path / "var", folder, plan, build, on_step=steps.append)
    assert len(steps) == 2 * 2 * 2  # 2 modes × 2 seeds × 2 steps
    assert all(s.credit.values.shape == (4, 256) for s in steps)  # m = 8: 2^8 coalitions
    assert all(s.credit.merge == "rrf" for s in steps)
    assert out["environment"] == {"retriever": "bm25", "merge": "rrf", "rrf_k": 60.0}
    same = ("steps", "rollouts", "rollouts_per_step", "actions")  # equal compute across modes
    assert {k: out["compute"]["broadcast"][k] for k in same} == {
        k: out["compute"]["shapley"][k] for k in same
    }
    assert out["compute"]["shapley"]["steps"] == 4 and out["compute"]["shapley"]["rollouts"] == 16
    sig = out["significance"]
    assert sig["complete"] and sig["seeds"] == {"broadcast": [0, 1], "shapley": [0, 1]}
    assert sig["n_claims"] == 8 and len(sig["pairs"]) == 2
    for p in sig["pairs"]:
        assert p["ci_low"] <= p["mean_diff"] <= p["ci_high"] and 0.0 <= p["p_one_sided"] <= 1.0
    assert set(out["per_claim"]["runs"]) == {f"{m}/seed{s}" for m in MODES for s in (0, 1)}
    table = (folder / "table.md").read_text()
    assert "retriever bm25, merge rrf (k = 60.0)" in table and "m=8" in table
    assert "| credit | seed 0 | seed 1 |" in table
    engine.dispose()
