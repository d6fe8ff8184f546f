"""`casi train` end to end on the tiny format policy and the SciFact slice, real Redis and real
databases: a 3-step run writes checkpoints, policy versions, complete metric rows and held-out
evaluations; a run killed with SIGKILL and resumed equals the uninterrupted run."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import select

from app.db.models import Evaluation, PolicyVersion, StepMetric, TrainingRun
from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.training.evaluate import build_eval_request, run_request
from app.training.policy_loader import LoadedPolicy
from app.training.runs import open_run
from app.training.train import run_training
from policy.evaluate import EvalConfig
from policy.model import policy_version, save_checkpoint
from policy.rollout import RolloutConfig
from policy.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
ARGS = dict(
    steps=3,
    queries=2,
    samples=3,
    n_actions=2,
    line_cap=10,
    lr=1e-3,
    anchor_query=False,
    eval_every=2,
    eval_queries=3,
    micro_batch_size=4,
)
REQUIRED = (
    "loss",
    "grad_norm",
    "step_applied",
    "reward_mean",
    "gain_mean",
    "format_ok_fraction",
    "lr",
    "time/step_s",
    "stack/kept_frac",
)


def _policy(model: Any, tok: Any) -> LoadedPolicy:
    return LoadedPolicy(model, tok, policy_version(model), "format", "tiny", "tiny", "base")


def test_a_runs_held_out_request_is_its_eval_section_on_its_rollout(slice_retrieval) -> None:  # type: ignore[no-untyped-def]
    """`casi train`'s held-out evaluations decode as its eval section says: on the split and
    claims it names, in the run's rollout shape, with serving's degenerate guard only when
    ``eval_refuse_degenerate`` is set (as `casi eval --refuse-degenerate`)."""
    for guard in (False, True):
        cfg = TrainConfig.from_preset(
            "casi", **ARGS, eval_split="val", eval_refuse_degenerate=guard
        )
        request = run_request(slice_retrieval, cfg)
        assert (request.split, len(request.queries)) == ("val", 3)
        assert request.config.rollout == cfg.rollout
        assert request.config.refuse_degenerate is guard
        assert request.config.precision == "float32"


@pytest.mark.integration
def test_three_step_run_records_everything(
    format_policy, smol_tokenizer, slice_retrieval, train_scorer, db_url, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    factory = make_session_factory(engine)
    cfg = TrainConfig.from_preset("casi", **ARGS)
    pol = _policy(copy.deepcopy(format_policy), smol_tokenizer)
    start_version = pol.version
    handle = open_run(
        factory, tmp_path, cfg, pol, "t3", {"policy": None, "evaluator": "replay", "max_docs": None}
    )
    request = build_eval_request(
        slice_retrieval, "test", 3, EvalConfig(RolloutConfig(n_actions=2, line_cap=10))
    )
    seen: list[int] = []
    trainer = run_training(
        factory,
        slice_retrieval,
        train_scorer,
        pol,
        cfg,
        handle,
        request,
        on_step=lambda r: seen.append(r.step),
    )
    assert seen == [1, 2, 3] and trainer.step == 3
    with factory() as session:
        run = session.get(TrainingRun, handle.run_id)
        assert run is not None and run.status == "finished" and run.config["train"]["steps"] == 3
        rows = session.scalars(
            select(StepMetric).where(StepMetric.run_id == handle.run_id).order_by(StepMetric.step)
        ).all()
        assert [r.step for r in rows] == [1, 2, 3]
        for r in rows:
            assert set(REQUIRED) <= set(r.metrics) and all(
                v == v for v in r.metrics.values()
            )  # no NaN
        evals = session.scalars(
            select(Evaluation).where(Evaluation.run_id == handle.run_id).order_by(Evaluation.step)
        ).all()
        assert [e.step for e in evals] == [0, 2, 3]
        for e in evals:
            assert e.split == "test" and e.n_queries == 3
            assert {
                "query_ndcg@10",
                "rewrites_ndcg@10",
                "combined_ndcg@10",
                "combined_recall@100",
                "gain_ndcg@10",
                "well_formed",
            } <= set(e.metrics)
            assert e.metrics["gain_ndcg@10"] == pytest.approx(
                e.metrics["combined_ndcg@10"] - e.metrics["query_ndcg@10"]
            )
        base = session.scalars(
            select(PolicyVersion).where(PolicyVersion.version == start_version)
        ).one()
        assert evals[0].policy_version_id == base.id  # step 0: the starting policy
        # every later evaluation belongs to the checkpoint of the weights it measured; weights
        # that moved are new 'trained' versions of this run, children of the starting policy
        final = session.get(PolicyVersion, evals[-1].policy_version_id)
        assert final is not None and final.version == policy_version(trainer.model) != start_version
        assert (
            final.kind == "trained" and final.run_id == handle.run_id and final.parent_id == base.id
        )
        assert (
            final.step == 3
            and final.meta["held_out"]["combined_ndcg@10"] == evals[-1].metrics["combined_ndcg@10"]
        )
        trained = session.scalars(
            select(PolicyVersion).where(PolicyVersion.run_id == handle.run_id)
        ).all()
        assert {p.id for p in trained} <= {e.policy_version_id for e in evals[1:]}
    assert (Path(final.path) / "model.safetensors").is_file()
    assert (handle.folder / "checkpoints" / "step-2" / "model.safetensors").is_file()
    lines = [json.loads(x) for x in handle.metrics_path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    engine.dispose()


def _casi(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _jsonl(var: Path, run: int) -> list[dict[str, Any]]:
    path = var / "runs" / str(run) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.integration
@pytest.mark.parametrize("params", ["full", "lora", "top"])
def test_resume_after_sigkill_equals_the_uninterrupted_run(
    params, format_policy, smol_tokenizer, slice_path, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    folder = save_checkpoint(format_policy, smol_tokenizer, tmp_path / "format-policy")
    var = tmp_path / "var"
    env = {**os.environ, "CASI_VAR_DIR": str(var), "CASI_DATASET": str(slice_path), "HF_HUB_OFFLINE": "1",
           "CASI_THREADS": "2", "DATABASE_URL": f"sqlite:///{tmp_path / 'casi.db'}"}  # fmt: skip
    env.pop("REDIS_URL", None)  # one embedded Redis for the three processes
    train = ["train", "--policy", str(folder), "--steps", "6", "--queries", "2", "--samples", "3", "--n-actions", "2",
             "--line-cap", "10", "--lr", "1e-3", "--no-anchor", "--seed", "5", "--params", params,
             *{"full": [], "lora": ["--lora-rank", "4"], "top": ["--top-layers", "1"]}[params]]  # fmt: skip
    full = _casi(env, *train, "--name", "full")
    out = full.communicate(timeout=600)[0].decode()
    assert full.returncode == 0, out
    killed = _casi(env, *train, "--name", "killed")
    deadline = time.time() + 300
    while len(_jsonl(var, 2)) < 2 and time.time() < deadline and killed.poll() is None:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert 2 <= len(_jsonl(var, 2)) < 6
    # the resume runs the game the run started in (stored with it), whatever the environment
    # says now: another retriever or stemmer here would change every step after the kill
    moved = {**env, "CASI_RETRIEVER": "bm25", "CASI_BM25_STEMMER": "none", "CASI_RETRIEVAL_K": "7"}
    resumed = _casi(moved, "train", "--resume", "2")
    out = resumed.communicate(timeout=600)[0].decode()
    assert resumed.returncode == 0, out
    a, b = _jsonl(var, 1), _jsonl(var, 2)
    assert [x["step"] for x in b] == [1, 2, 3, 4, 5, 6]  # nothing lost, nothing duplicated
    for x, y in zip(a, b, strict=True):
        det = {
            k: v for k, v in x.items() if not k.startswith(("time/", "cache/"))
        }  # wall time, cache warmth
        assert det == {k: y[k] for k in det}, f"step {x['step']} differs"
    weights = "adapter_model.safetensors" if params == "lora" else "model.safetensors"
    wa = load_file(var / "runs" / "1" / "checkpoints" / "step-6" / weights)
    wb = load_file(var / "runs" / "2" / "checkpoints" / "step-6" / weights)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    if params == "lora":  # only the adapter is stored, and it trained (B starts at zero)
        assert all("lora_" in k for k in wa)
        assert any(k.endswith("lora_B.weight") and wa[k].abs().sum() > 0 for k in wa)
    else:
        assert not all(
            torch.equal(wa[k], v) for k, v in format_policy.state_dict().items() if k in wa
        )  # it trained
