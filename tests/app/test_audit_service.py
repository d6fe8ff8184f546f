"""The audit service end to end on the tiny policy and the SciFact slice, with real Redis and
real databases (SQLite and PostgreSQL): one credit call scores both evaluators, the report
validates against its schema, files and rows are written, stored runs and API job rows work.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from sqlalchemy import Engine

from app.db import repositories as repo
from app.db import session_scope
from app.db.session import make_session_factory
from app.reports.audit_json import summary, validate_report
from app.services import audit as service
from app.training.policy_loader import LoadedPolicy
from evaluator.audit import AuditConfig, Games, audit
from evaluator.credit import RolloutActions, compute_credits
from evaluator.scorers import make_scorer
from policy.model import policy_version

REQUEST: dict[str, Any] = dict(
    evaluators=("cosine",),
    split="train",
    queries=2,
    samples=3,
    n_actions=2,
    line_cap=10,
    n_boot=200,
    batch_queries=1,
)  # fmt: skip  (the format_policy fixture answers the first 2 train queries with 2 rewrites)


@pytest.fixture()
def scorers(slice_dataset, slice_index):  # type: ignore[no-untyped-def]
    qrels: dict[str, dict[int, int]] = {}
    for split in slice_dataset.qrels:
        qrels.update(slice_dataset.qrels_rows(split))
    emb = torch.from_numpy(slice_index.embeddings)
    return {
        "replay": make_scorer("replay", qrels=qrels, k=10),
        "cosine": make_scorer("cosine", doc_emb=emb, k=10),
    }


@pytest.fixture()
def loader(format_policy, smol_tokenizer):  # type: ignore[no-untyped-def]
    model = copy.deepcopy(format_policy).eval()
    policy = LoadedPolicy(
        model, smol_tokenizer, policy_version(model), "tiny", "tiny", "tiny", "base"
    )
    return lambda ref: policy


def _run(request, retrieval, scorers, engine: Engine, out: Path, **kw):  # type: ignore[no-untyped-def]
    return service.run_audit(
        request, retrieval=retrieval, scorers=scorers, factory=make_session_factory(engine),
        out_dir=out, list_k=10, **kw,
    )  # fmt: skip


@pytest.mark.integration
def test_sampled_audit_end_to_end(slice_retrieval, scorers, loader, db_engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    seen: list[tuple[int, int]] = []
    request = service.AuditRequest(**REQUEST)
    [out] = _run(request, slice_retrieval, scorers, db_engine, tmp_path, load_policy=loader,
                 progress=lambda n, t: seen.append((n, t)))  # fmt: skip
    report = out.report
    validate_report(report)
    assert seen == [(1, 2), (2, 2)]  # one sampling call per query (batch_queries = 1)
    assert report["n_rollouts"] == 6 and report["n_queries"] == 2
    assert report["train_evaluator"]["name"] == "cosine" and report["meta"]["source"] == "sampled"
    assert report["meta"]["anchor_query"] is True and report["meta"]["split"] == "train"

    # pairs per size: a rollout with m real actions has m·C(m−1, k−1) marginals of size k
    saved = json.loads(out.json_path.with_name(f"audit-{out.id}-rollouts.json").read_text())
    ms = [len(r["actions"]) for r in saved["rollouts"]]
    want = [sum(m * math.comb(m - 1, k - 1) for m in ms) for k in (1, 2)]
    assert [s["n_pairs"] for s in report["sizes"]] == want and want[0] >= 6

    # the one-call games equal two separate credit calls on the same actions
    actions = [
        RolloutActions(r["query_id"], r["query_text"], r["actions"]) for r in saved["rollouts"]
    ]
    cos = compute_credits(actions, slice_retrieval.executor, scorers["cosine"], 10, n_players=2)
    ref = compute_credits(actions, slice_retrieval.executor, scorers["replay"], 10, n_players=2)
    qids = sorted({a.query_id for a in actions})
    groups = torch.tensor([qids.index(a.query_id) for a in actions])
    direct = audit(Games(cos.values, ref.values, cos.n_actions, groups), AuditConfig(n_boot=200))
    assert [s["agree"] for s in report["sizes"]] == pytest.approx(
        direct.sizes.agree.estimate.tolist(), nan_ok=True
    )

    # files and the row
    assert out.html_path.read_text().startswith("<!doctype html>")
    assert json.loads(out.json_path.read_text()) == report
    found = service.get_audit(make_session_factory(db_engine), out.id)
    assert found is not None and found["report"] == report and found["verdict"] == report["verdict"]
    assert found["html_path"] == str(out.html_path) and found["status"] == "finished"
    listed = service.list_audits(make_session_factory(db_engine))
    assert [a["id"] for a in listed] == [out.id] and listed[0]["n_rollouts"] == 6


@pytest.mark.integration
def test_two_training_evaluators_share_the_rollouts_and_a_saved_file_reaudits(
    slice_retrieval, scorers, loader, db_engine, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    scorers = {**scorers, "replay10": scorers["replay"]}  # a second "training" evaluator
    request = service.AuditRequest(**{**REQUEST, "evaluators": ("cosine", "replay10")})
    with pytest.raises(ValueError, match="distinct names"):  # same scorer name twice in one call
        _run(request, slice_retrieval, scorers, db_engine, tmp_path, load_policy=loader)
    first, = _run(service.AuditRequest(**REQUEST), slice_retrieval, scorers, db_engine, tmp_path,
                  load_policy=loader)  # fmt: skip
    rollouts_file = first.json_path.with_name(f"audit-{first.id}-rollouts.json")
    again, = _run(service.AuditRequest(**{**REQUEST, "from_rollouts": str(rollouts_file)}),
                  slice_retrieval, scorers, db_engine, tmp_path)  # fmt: skip
    assert again.id != first.id and again.report["sizes"] == first.report["sizes"]
    assert again.report["meta"]["rollouts_file"] == str(rollouts_file)


@pytest.mark.integration
def test_audit_of_a_stored_run_and_of_a_queued_job_row(
    slice_retrieval, slice_dataset, scorers, db_engine, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    factory = make_session_factory(db_engine)
    qids = slice_dataset.split_query_ids("train")[:3]
    with session_scope(factory) as session:
        run = repo.create_run(session, name="r", preset="casi", config={})
        empty = repo.create_run(session, name="empty", preset="casi", config={})
        repo.add_credit_records(
            session,
            [_record(run.id, q, slice_dataset.queries[q], s) for q in qids for s in range(2)],
        )
        run_id, empty_id = run.id, empty.id
    job = service.create_pending(factory, service.AuditRequest(**{**REQUEST, "from_run": run_id}))
    assert service.get_audit(factory, job)["status"] == "queued"  # type: ignore[index]
    [out] = _run(service.AuditRequest(**{**REQUEST, "from_run": run_id, "queries": 2}),
                 slice_retrieval, scorers, db_engine, tmp_path, audit_id=job)  # fmt: skip
    assert out.id == job and out.report["meta"]["source"] == "run" and out.report["n_rollouts"] == 4
    assert out.report["meta"]["run_id"] == run_id and out.report["meta"]["anchor_query"] is False
    assert service.get_audit(factory, job)["status"] == "finished"  # type: ignore[index]

    with pytest.raises(ValueError, match=f"run {empty_id} has no credit records"):
        _run(
            service.AuditRequest(**{**REQUEST, "from_run": empty_id}),
            slice_retrieval,
            scorers,
            db_engine,
            tmp_path,
        )
    with pytest.raises(LookupError, match="no training run with id 999"):
        _run(
            service.AuditRequest(**{**REQUEST, "from_run": 999}),
            slice_retrieval,
            scorers,
            db_engine,
            tmp_path,
        )
    failed = service.create_pending(factory, service.AuditRequest(**REQUEST))
    service.set_status(factory, failed, "failed", error="boom")
    row = service.get_audit(factory, failed)
    assert row is not None and row["status"] == "failed" and row["report"]["error"] == "boom"


def _record(run_id: int, qid: str, text: str, sample: int) -> dict[str, Any]:
    actions = [text, "zebra"] if sample == 0 else [text + " evidence", "protein", "cells"]
    m = len(actions)
    return {
        "run_id": run_id, "step": 1, "query_id": qid, "query_text": text, "sample_index": sample,
        "policy_version": "p" * 12, "actions": actions, "value_table": [0.0] * 2**m,
        "credits": [0.0] * m, "value_full": 0.0, "efficiency_residual": 0.0,
        "index_version": "i", "embedder_version": "e", "evaluator_name": "replay",
        "evaluator_version": "v", "anchor_query": False,
    }  # fmt: skip


def test_request_validation_is_clear() -> None:
    with pytest.raises(ValueError, match="'replay' is both the reference and a training evaluator"):
        service.AuditRequest(evaluators=("replay",))
    with pytest.raises(ValueError, match="unknown split 'validation'"):  # dev is one (NFCorpus)
        service.AuditRequest(evaluators=("cosine",), split="validation")
    with pytest.raises(ValueError, match="prompt must be one of"):
        service.AuditRequest(evaluators=("cosine",), prompt="chatty")
    with pytest.raises(ValueError, match="n_actions must be in 1..12"):
        service.AuditRequest(evaluators=("cosine",), n_actions=13)
    with pytest.raises(ValueError, match="threshold"):
        service.AuditRequest(evaluators=("cosine",), threshold=1.5)


@pytest.mark.integration
def test_unknown_evaluator_lists_the_available_ones(
    slice_retrieval, scorers, db_engine, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(
        ValueError,
        match=r"evaluator 'surrogate' is not available here; available: \['cosine', 'replay'\]",
    ):
        _run(
            service.AuditRequest(evaluators=("surrogate",)),
            slice_retrieval,
            scorers,
            db_engine,
            tmp_path,
        )


def _synthetic_report() -> dict[str, Any]:
    """A report from seeded games (no retrieval): training = reference + noise."""
    from app.reports.audit_json import build_report

    gen = torch.Generator().manual_seed(0)
    ref = torch.rand(40, 16, generator=gen, dtype=torch.float64)
    train = ref + 0.3 * torch.randn(40, 16, generator=gen, dtype=torch.float64)
    games = Games(train, ref, torch.full((40,), 4), torch.arange(40) // 4)
    result = audit(games, AuditConfig(n_boot=100))
    who = {"name": "surrogate", "version": "s1"}, {"name": "replay", "version": "r1"}
    return build_report(result, train=who[0], reference=who[1], meta={"source": "sampled"})


def test_report_json_validates_and_broken_reports_do_not() -> None:
    report = _synthetic_report()
    validate_report(report)
    json.dumps(report, allow_nan=False)  # strict JSON: no NaN / Infinity anywhere
    for path, bad in ((("sizes", 0, "agree"), 1.5), (("verdict",), "maybe"), (("n_rollouts",), 0)):
        broken = copy.deepcopy(report)
        target = broken
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = bad
        with pytest.raises(jsonschema.ValidationError):
            validate_report(broken)


def test_the_agreement_plot_takes_an_estimate_outside_its_interval() -> None:
    """With few resamples the point estimate can fall outside its percentile interval; the
    plot's error bars were then negative and matplotlib refused them, after the JSON was written
    (an orphan audit file). The report also carries leave-one-out's own agreement."""
    from app.reports.audit_plots import agreement_by_size

    report = _synthetic_report()
    assert "leave_one_out_agree" in report
    row = next(r for r in report["sizes"] if r["has_pairs"])
    row["agree"], row["ci_low"], row["ci_high"] = 0.5, 0.6, 0.7  # above and below the estimate
    validate_report(report)
    assert agreement_by_size(report)  # the SVG, no ValueError


def test_summary_says_the_verdict_in_plain_words() -> None:
    report = _synthetic_report()
    for r, passed in zip(report["sizes"], (True, True, False, False), strict=True):
        r["passed"], r["agree"] = passed, 0.9 if passed else 0.6
    report["recommended_credit"] = "singleton"
    text = summary(report)
    assert text.startswith(
        "The surrogate evaluator disagrees with replay too often at size 3: 0.60, size 4: 0.60"
    )
    assert "it agrees at size 1: 0.90, size 2: 0.90" in text and "prefer singleton credit" in text
    for r in report["sizes"]:
        r["passed"], r["agree"] = True, 0.95
    report["recommended_credit"] = "shapley"
    assert "at every coalition size (lowest: 0.95 at size 1" in summary(report)
