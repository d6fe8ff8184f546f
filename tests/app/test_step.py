"""`casi step` end to end on the tiny model and the SciFact slice, with real Redis and real
databases (SQLite and PostgreSQL): records, advantage invariants, update, cache reuse.

The tiny model is first taught (SFT, memorisation) to answer two real train queries with two
numbered rewrites — one on-topic, one junk — so the step has real actions whose credits differ.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from sqlalchemy import select

from app.db.models import CreditRecord, StepMetric, TrainingRun
from app.db.session import make_engine, make_session_factory
from app.settings import Settings
from app.training.step import run_step
from evaluator.scorers import make_scorer

N_QUERIES, N_SAMPLES, N_ACTIONS = (
    2,
    3,
    2,
)  # the format_policy fixture answers 2 queries with 2 rewrites
STEP_ARGS: dict[str, Any] = dict(
    n_queries=N_QUERIES,
    n_samples=N_SAMPLES,
    n_actions=N_ACTIONS,
    preset="casi",
    lr=1e-3,
    seed=0,
    line_cap=10,
    anchor_query=False,  # the plain game: on this easy slice the query alone finds everything
)


@pytest.mark.integration
def test_step_end_to_end(
    format_policy,
    smol_tokenizer,
    slice_dataset,
    embedder,
    slice_index,
    redis_client,
    slice_retrieval,
    db_url,
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(var_dir=tmp_path, DATABASE_URL=db_url)
    retrieval = slice_retrieval
    scorer = make_scorer("replay", qrels=slice_dataset.qrels_rows("train"), k=10)
    model = copy.deepcopy(format_policy)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = run_step(settings, retrieval, scorer, model, smol_tokenizer, **STEP_ARGS)
    res = report.result

    # real actions were produced and credited, with differing credits inside rollouts
    assert sum(len(r.parsed.actions) for r in res.rollouts) >= N_QUERIES * N_SAMPLES
    assert float(res.shaped.abs().max()) > 0.1
    # bounded zero-sum shaping: per-sample shaped advantages sum to 0 over actions
    torch.testing.assert_close(
        res.shaped.sum(-1), torch.zeros_like(res.shaped.sum(-1)), rtol=0, atol=1e-9
    )
    assert float(res.shaped.abs().max()) <= 2.0 + 1e-12
    # shared tokens carry exactly the base advantage; action tokens A + λx
    base = res.base.reshape(-1)
    for i in range(len(res.rollouts)):
        shared = res.batch.shared_token_mask[i] & res.batch.response_mask[i]
        assert torch.all(res.token_adv[i][shared] == base[i].float())
        for j in range(N_ACTIONS):
            span = res.batch.action_token_mask[i, j]
            if span.any():
                want = (base[i] + report.lam * res.shaped.reshape(-1, N_ACTIONS)[i, j]).float()
                torch.testing.assert_close(res.token_adv[i][span], want.expand(int(span.sum())))
    # the policy moved, and only to finite values
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert report.version_before != report.version_after and res.metrics["step_applied"] == 1.0

    # records are complete
    engine = make_engine(settings.sqlalchemy_url)
    with make_session_factory(engine)() as session:
        rows = session.scalars(
            select(CreditRecord).where(CreditRecord.run_id == report.run_id)
        ).all()
        assert len(rows) == report.n_records == N_QUERIES * N_SAMPLES
        for row in rows:
            m = len(row.actions)
            assert len(row.value_table) == 2**m and len(row.credits) == m
            assert set(row.baselines) == {"singleton", "leave_one_out", "broadcast"}
            assert len(row.advantages["shaped"]) == m and abs(sum(row.advantages["shaped"])) < 1e-9
            assert abs(sum(row.credits) - (row.value_table[-1] - row.value_table[0])) < 1e-9
            assert row.policy_version == report.version_before
            assert row.index_version == slice_index.version and row.evaluator_name == "replay"
        run = session.get(TrainingRun, report.run_id)
        assert run is not None and run.status == "finished" and run.preset == "casi"
        metrics = session.scalars(
            select(StepMetric).where(StepMetric.run_id == report.run_id)
        ).one()
        assert "ppo_clip/clip_frac" in metrics.metrics and "tis_token/ess" in metrics.metrics
    engine.dispose()

    # the same step again reuses the cached actions
    again = run_step(
        settings, retrieval, scorer, copy.deepcopy(format_policy), smol_tokenizer, **STEP_ARGS
    )
    assert again.result.credit.cache["hits"] > 0 and again.result.credit.cache["status"] == "ok"


@pytest.mark.integration
def test_surrogate_stays_frozen_through_a_training_step(
    format_policy, smol_tokenizer, slice_dataset, embedder, slice_index, slice_retrieval, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """The training evaluator is frozen: a full step (credit + backward + optimizer step on the
    policy) leaves every surrogate weight bit-identical and gives it no gradient."""
    from evaluator.scorers.surrogate import SurrogateConfig, SurrogateNet, save_surrogate

    torch.manual_seed(0)
    path = tmp_path / "surrogate.safetensors"
    save_surrogate(SurrogateNet(SurrogateConfig()), path)
    scorer = make_scorer(
        "surrogate",
        doc_emb=torch.from_numpy(slice_index.embeddings),
        k=10,
        surrogate_path=path,
        doc_fingerprint=slice_index.version,
    )
    weights = {k: v.clone() for k, v in scorer.model.state_dict().items()}
    settings = Settings(var_dir=tmp_path, DATABASE_URL=f"sqlite:///{tmp_path / 'casi.db'}")
    retrieval = slice_retrieval
    report = run_step(
        settings, retrieval, scorer, copy.deepcopy(format_policy), smol_tokenizer, **STEP_ARGS
    )
    assert report.result.credit.versions["evaluator_name"] == "surrogate"
    assert report.version_before != report.version_after  # the policy did move
    for name, value in scorer.model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert all(p.grad is None and not p.requires_grad for p in scorer.model.parameters())
