"""What the dashboard tests put in the database, through `app.db.repositories` (and, for the
credit records of one step and one API credit, through the REAL credit path on the server's own
retrieval stack and replay evaluator, so φ, v(S) and the hits are real).

`seed(state, tiny_policy)` returns the ids the tests look for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.api.state import AppState
from app.db import repositories as repo
from app.db import session_scope
from app.db.models import JobStatus, RunStatus, utcnow
from app.db.records import RETRIEVED_ROWS
from evaluator.credit import RolloutActions, compute_credits
from evaluator.shapley import broadcast, exact_shapley, leave_one_out, singleton
from policy.advantages import base_advantages, shape_credits
from policy.train_config import TrainConfig

XSS = "<script>document.title='pwned'</script> binding <b>bold</b>"
N_STEPS = 30
BIG_QUERIES, BIG_SAMPLES = 700, 4  # 2,800 credit records in one step of the "big" run


ZEN4 = "AuthenticAMD family 25 model 17 stepping 1"  # where the seeded warm start was made


@dataclass
class Seeded:
    run_id: int = 0
    overlay_run_id: int = 0
    big_run_id: int = 0
    explorer_step: int = N_STEPS
    credit_ids: list[int] = field(default_factory=list)
    xss_record_id: int = 0
    api_credit_id: int = 0
    warm_version: str = ""
    ckpt_version: str = ""
    tiny_version: str = ""
    audit_id: int = 0
    job_id: int = 0


def _metrics(step: int, credit: str) -> dict[str, float]:
    t = step / N_STEPS
    bump = 0.02 if credit == "shapley" else 0.0
    return {
        "reward_mean": 0.55 + 0.2 * t + bump + 0.02 * math.sin(step), "query_alone_mean": 0.55,
        "gain_mean": 0.2 * t + bump - 0.05, "mismatch/kl_k3": 1e-3 * (1 + t), "kl/value": 2e-3 * t,
        "ppo_clip/clip_frac": 0.05 * t, "stack/kept_frac": 0.97, "format_ok_fraction": 0.5 + 0.4 * t,
        "count/mipu_accepted": float(step % 3 != 0), "count/mipu_rejected": float(step % 3 == 0),
        "time/step_s": 9.5 + 0.5 * math.cos(step), "step_applied": 1.0,
    }  # fmt: skip


def _eval_metrics(step: int) -> dict[str, float]:
    t = step / N_STEPS
    q, r = 0.70, 0.68 + 0.05 * t
    c = q + 0.01 + 0.02 * t
    return {"query_ndcg@10": q, "rewrites_ndcg@10": r, "combined_ndcg@10": c, "gain_ndcg@10": c - q,
            "query_recall@100": 0.9, "rewrites_recall@100": 0.88 + 0.04 * t,
            "combined_recall@100": 0.93 + 0.02 * t, "gain_recall@100": 0.03 + 0.02 * t,
            "well_formed": 0.5 + 0.4 * t}  # fmt: skip


def _config(credit: str, state: AppState) -> dict[str, Any]:
    cfg = TrainConfig.from_preset("casi", steps=N_STEPS, queries=3, samples=3, n_actions=3,
                                  list_k=state.settings.list_k, credit=credit)  # fmt: skip
    return {"train": cfg.to_dict(), "evaluator": "replay", "policy": "warmstart"}


def _real_step_records(state: AppState, run_id: int, step: int) -> list[dict[str, Any]]:
    """3 train queries × 3 samples, the plain game (no anchor: on this small slice the query alone
    already finds its documents, so every credit would be 0): rewrites = a relevant document's title, the query's words,
    junk (one sample carries the XSS string), credited by THE credit path with replay."""
    ds = state.retrieval.dataset
    titles = {d.doc_id: d.title for d in ds.documents}
    qids = ds.split_query_ids("train")[:3]
    rollouts = []
    for qid in qids:
        text = ds.queries[qid]
        rel = [d for d in ds.qrels["train"][qid] if d in titles]
        title = titles[rel[0]] if rel else text
        words = " ".join(text.split()[:4])
        rollouts += [
            RolloutActions(qid, text, [title, words, "zebra migration patterns"]),
            RolloutActions(qid, text, [words, "quantum chromodynamics lattice", title.lower()]),
            RolloutActions(qid, text, [XSS if qid == qids[0] else "ocean salinity", title, words]),
        ]
    res = compute_credits(rollouts, state.retrieval.executor, state.scorers["replay"],
                          state.settings.list_k, anchor_query=False)  # fmt: skip
    rewards = res.values[:, -1].reshape(len(qids), 3)
    base = base_advantages(rewards.double(), "grpo")
    mask = torch.ones(len(qids), 3, 3, dtype=torch.bool)
    shaped = shape_credits(res.phi[:, :3].reshape(len(qids), 3, 3), mask)
    rows = []
    for i in range(len(rollouts)):
        rec = {k: v for k, v in res.record(i).items() if k not in RETRIEVED_ROWS}
        b, s = divmod(i, 3)
        rows.append({**rec, "run_id": run_id, "step": step, "sample_index": s, "policy_version": "seeded",
                     "format_status": "ok" if s != 1 else "too_few",
                     "advantages": {"base": float(base[b, s]), "shaped": shaped[b, s].tolist()},
                     "cache_stats": {"status": "ok"}})  # fmt: skip
    return rows


def _synthetic_records(
    run_id: int, step: int, n_queries: int, g: int, m: int = 4
) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(7)
    values = torch.rand(n_queries * g, 2**m, generator=gen, dtype=torch.float64)
    phi, sing = exact_shapley(values, m), singleton(values, m)
    loo, bc = leave_one_out(values, m), broadcast(values, m)
    return [
        {"run_id": run_id, "step": step, "query_id": f"q{i // g:05d}", "query_text": f"synthetic query {i // g}",
         "sample_index": i % g, "policy_version": "seeded", "actions": [f"rewrite {i}-{j}" for j in range(m)],
         "format_status": "ok", "value_table": values[i].tolist(), "credits": phi[i].tolist(),
         "baselines": {"singleton": sing[i].tolist(), "leave_one_out": loo[i].tolist(), "broadcast": bc[i].tolist()},
         "advantages": {"base": 0.1, "shaped": [0.5, -0.5, 0.25, -0.25]}, "value_full": float(values[i, -1]),
         "efficiency_residual": 0.0, "index_version": "other-index", "embedder_version": "other-embedder",
         "evaluator_name": "replay", "evaluator_version": "v", "cache_stats": None, "anchor_query": True}
        for i in range(n_queries * g)
    ]  # fmt: skip


def audit_report() -> dict[str, Any]:
    """A real audit report (the audit math on synthetic games, as the report's browser test)."""
    from app.reports.audit_json import build_report
    from evaluator.audit import AuditConfig, Games, audit

    gen = torch.Generator().manual_seed(3)
    n = 80
    ref = torch.rand(n, 16, generator=gen, dtype=torch.float64).round(decimals=1)
    train = ref + 0.25 * torch.randn(n, 16, generator=gen, dtype=torch.float64) * torch.arange(
        16
    ).div(15)
    result = audit(
        Games(train, ref, torch.tensor([4] * n), torch.arange(n) // 4), AuditConfig(n_boot=100)
    )
    return build_report(result, train={"name": "surrogate", "version": "abc"},
                        reference={"name": "replay", "version": "def"},
                        meta={"source": "sampled", "split": "test", "anchor_query": True})  # fmt: skip


def _run(session: Any, state: AppState, name: str, credit: str, warm_id: int) -> int:
    run = repo.create_run(session, name=name, preset="casi", config=_config(credit, state),
                          policy_version_id=warm_id)  # fmt: skip
    for step in range(1, N_STEPS + 1):
        repo.add_step_metrics(session, run.id, step, _metrics(step, credit), accepted=step % 3 != 0)
    for step in (0, 15, 30):
        repo.add_evaluation(session, policy_version_id=warm_id, split="test", n_queries=50,
                            metrics=_eval_metrics(step), run_id=run.id, step=step)  # fmt: skip
    repo.finish_run(session, run.id, status=RunStatus.FINISHED)
    return run.id


def seed(state: AppState, tiny_policy: Path, log_dir: Path, audit_report: dict[str, Any]) -> Seeded:
    out = Seeded()
    served = state.batcher.policy.version
    with session_scope(state.factory) as s:
        base = repo.get_policy_version_by_version(s, served)
        assert base is not None
        warm = repo.add_policy_version(s, version="a1" * 6 + "0" * 52, name="warmstart <i>x</i>",
                                       base_model="tiny", path="/nonexistent/warm", kind="warmstart",
                                       parent_id=base.id, meta={"made_on": ZEN4,
                                       "imported_from": "start<b>.tar"})  # fmt: skip
        out.warm_version = warm.version
        out.run_id = _run(s, state, "credit-shapley", "shapley", warm.id)
        out.overlay_run_id = _run(s, state, "credit-singleton", "singleton", warm.id)
        ckpt = repo.add_policy_version(s, version="b2" * 6 + "0" * 52, name="checkpoint", base_model="tiny",
                                       path="/nonexistent/ckpt", kind="trained", step=15, parent_id=warm.id)  # fmt: skip
        ckpt.run_id = out.run_id
        out.ckpt_version = ckpt.version
        repo.add_evaluation(
            s, policy_version_id=ckpt.id, split="test", n_queries=50, metrics=_eval_metrics(15)
        )
        rows = repo.add_credit_records(s, _real_step_records(state, out.run_id, out.explorer_step))
        out.credit_ids = [r.id for r in rows]
        out.xss_record_id = next(r.id for r in rows if XSS in r.actions)
        big = repo.create_run(
            s,
            name="big",
            preset="casi",
            config=_config("shapley", state),
            policy_version_id=warm.id,
        )
        out.big_run_id = big.id
        repo.add_step_metrics(s, big.id, 1, _metrics(1, "shapley"))
        repo.add_credit_records(s, _synthetic_records(big.id, 1, BIG_QUERIES, BIG_SAMPLES))
        audit = repo.add_audit_report(s, train_evaluator="surrogate", reference_evaluator="replay",
                                      n_rollouts=audit_report["n_rollouts"], report=audit_report,
                                      verdict=audit_report["verdict"])  # fmt: skip
        out.audit_id = audit.id
        job = repo.create_train_job(s, preset="casi", overrides={"steps": 2})
        log = log_dir / f"job-{job.id}.log"
        log.write_text("step 1 reward 0.5\n<script>alert('log')</script>\n")
        repo.update_train_job(s, job, status=JobStatus.FINISHED, log_path=str(log), run_name=f"job-{job.id}",
                              started_at=utcnow(), finished_at=utcnow(), exit_code=0)  # fmt: skip
        out.job_id = job.id
    # an API credit, through the REST API's own service (the one credit path, persisted)
    from app.schemas import CreditRequest
    from app.services.credits import compute_and_store

    ds = state.retrieval.dataset
    qid = ds.split_query_ids("train")[0]
    resp = compute_and_store(CreditRequest(query_id=qid, rewrites=["protein folding", ds.queries[qid]]),
                             state.retrieval, state.scorers, state.factory, list_k=state.settings.list_k)  # fmt: skip
    out.api_credit_id = resp.id
    # a second real policy, registered with its content hash, that an admin can activate
    from app.services.policies import load_serving_policy

    tiny = load_serving_policy(
        str(tiny_policy), state.settings.var_dir, None, device="cpu", precision="float32"
    )
    with session_scope(state.factory) as s:
        repo.add_policy_version(s, version=tiny.version, name="tiny-1", base_model=str(tiny_policy),
                                path=str(tiny_policy), kind="trained", parent_id=None)  # fmt: skip
    out.tiny_version = tiny.version
    return out
