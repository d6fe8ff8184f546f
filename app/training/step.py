"""The `casi step` service: ONE training step (a debug command), printed and recorded.

Read :func:`run_step`. It builds the same `Trainer` as `casi train` (from a `TrainConfig` with
steps = 1), takes one step on the first B train queries and records the run, its step metrics
and one credit record per rollout. No resume state, no checkpoint: use `casi train` to train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from app.db import repositories as repo
from app.db import session_scope
from app.db.connect import connect
from app.db.models import PolicyKind, RunStatus
from app.db.records import credit_record
from app.runtime import Retrieval
from app.settings import Settings
from app.training.splits import train_val_ids
from evaluator.scorers import SetScorer
from policy.constrain import DEFAULT_LINE_CAP
from policy.model import policy_version
from policy.train_config import TrainConfig
from policy.trainer import StepResult, Trainer


@dataclass
class StepReport:
    result: StepResult
    run_id: int
    n_records: int
    version_before: str
    version_after: str
    database: str
    queries: list[tuple[str, str]]
    lam: float  # λ of the token mapping A + λ·x


def pick_queries(retrieval: Retrieval, n: int) -> list[tuple[str, str]]:
    """The first ``n`` training queries (file order: deterministic)."""
    qids = train_val_ids(retrieval.dataset)[0][:n]
    if len(qids) < n:
        raise ValueError(f"the train split has only {len(qids)} training queries, asked for {n}")
    return [(q, retrieval.dataset.queries[q]) for q in qids]


def run_step(
    settings: Settings,
    retrieval: Retrieval,
    scorer: SetScorer,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    n_queries: int,
    n_samples: int,
    n_actions: int,
    preset: str = "casi",
    lr: float = 1e-5,
    seed: int = 0,
    max_new_tokens: int | None = None,
    format: str = "constrained",
    line_cap: int = DEFAULT_LINE_CAP,
    precision: str = "float32",
    temperature: float = 0.7,
    model_path: str = "default:SmolLM2-135M-Instruct",
    anchor_query: bool = True,
) -> StepReport:
    """One real step; writes run, policy version, step metrics and credit records."""
    cfg = TrainConfig.from_preset(
        preset, steps=1, queries=n_queries, samples=n_samples, n_actions=n_actions,
        list_k=settings.list_k, lr=lr, seed=seed, max_new_tokens=max_new_tokens,
        format=format, line_cap=line_cap,
        precision=precision, temperature=temperature, anchor_query=anchor_query,
    )  # fmt: skip
    queries = pick_queries(retrieval, n_queries)
    torch.manual_seed(seed)
    before = policy_version(model)
    trainer = Trainer(model, tokenizer, cfg, retrieval.executor, scorer, version=before)
    result = trainer.train_step(queries)
    after = policy_version(model)
    run_id, n = _record(settings, result, before, after, cfg, model_path)
    return StepReport(
        result, run_id, n, before, after, settings.sqlalchemy_url, queries, cfg.shaping.lam
    )


def credit_records(result: StepResult, run_id: int | None, step: int) -> list[dict[str, Any]]:
    """Rows for the credit_records table, one per rollout (`app.db.records.credit_record`)."""
    g = result.base.shape[1]
    rows = []
    for i, r in enumerate(result.rollouts):
        b, s = divmod(i, g)
        m = int(result.credit.n_actions[i])
        advantages = {"base": float(result.base[b, s]), "shaped": result.shaped[b, s, :m].tolist()}
        rows.append(credit_record(
            result.credit, i, run_id=run_id, step=step, sample_index=r.sample_index,
            policy_version=r.policy_version, format_status=r.parsed.status, advantages=advantages,
        ))  # fmt: skip
    return rows


def _record(
    settings: Settings,
    result: StepResult,
    before: str,
    after: str,
    cfg: TrainConfig,
    model_path: str,
) -> tuple[int, int]:
    with connect(settings, migrate=True) as db, session_scope(db.factory) as session:
        pv = repo.get_or_add_policy_version(
            session, version=before, name="policy", base_model=model_path, path=model_path,
            kind=PolicyKind.BASE,
        )  # fmt: skip
        run = repo.create_run(
            session,
            name=f"step-{cfg.preset}",
            preset=cfg.preset,
            config=cfg.to_dict(),
            policy_version_id=pv.id,
        )
        repo.add_step_metrics(session, run.id, 1, result.metrics, accepted=result.accepted)
        rows = credit_records(result, run.id, 1)
        repo.add_credit_records(session, rows)
        repo.finish_run(
            session, run.id, status=RunStatus.FINISHED, notes=f"policy {before} -> {after}"
        )
        return run.id, len(rows)
