"""The `casi step` service: compose the real components, run ONE training step, record it.

Read first: :func:`run_step`. The service owns the one database transaction that stores the
run, the policy version, the step metrics and every rollout's credit record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.db import repositories as repo
from app.db import session_scope
from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.runtime import Retrieval
from app.settings import Settings
from policy.advantages import ShapingConfig
from policy.forward import ValueHead
from policy.losses.presets import load_preset
from policy.losses.stack import LossStack
from policy.model import policy_version
from policy.sampler import SamplerConfig
from policy.trainer import StepConfig, StepResult, train_step


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


def pick_queries(retrieval: Retrieval, n: int, split: str = "train") -> list[tuple[str, str]]:
    """The first ``n`` judged queries of ``split`` (file order: deterministic)."""
    ds = retrieval.dataset
    qids = ds.split_query_ids(split)[:n]
    if len(qids) < n:
        raise ValueError(f"split {split!r} has only {len(qids)} judged queries, asked for {n}")
    return [(q, ds.queries[q]) for q in qids]


def run_step(
    settings: Settings,
    retrieval: Retrieval,
    scorer: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    n_queries: int,
    n_samples: int,
    n_actions: int,
    preset: str = "casi",
    lr: float = 1e-5,
    seed: int = 0,
    max_new_tokens: int = 64,
    precision: str = "float32",
    temperature: float = 0.7,
    model_path: str = "default:SmolLM2-135M-Instruct",
    anchor_query: bool = True,
) -> StepReport:
    """One real step; writes run, policy version, step metrics and credit records."""
    stack_cfg = load_preset(preset)
    cfg = StepConfig(
        n_samples=n_samples,
        n_actions=n_actions,
        list_k=settings.list_k,
        anchor_query=anchor_query,
        sampler=SamplerConfig(
            max_new_tokens=max_new_tokens, seed=seed, precision=precision, temperature=temperature
        ),
        shaping=stack_cfg.advantages or ShapingConfig(),
    )
    queries = pick_queries(retrieval, n_queries)
    torch.manual_seed(seed)
    value_head = None
    params = list(model.parameters())
    if stack_cfg.critic.kind != "none":
        hidden_size: int = getattr(model.config, "hidden_size")  # noqa: B009  (HF config attr)
        value_head = ValueHead(hidden_size)
        params += list(value_head.parameters())
    optimizer = torch.optim.AdamW(
        params, lr=lr, weight_decay=0.0
    )  # only the gradient moves weights
    before = policy_version(model)
    result = train_step(
        model,
        tokenizer,
        optimizer,
        LossStack(stack_cfg),
        queries,
        retrieval.executor,
        scorer,
        cfg,
        policy_version=before,
        value_head=value_head,
    )
    after = policy_version(model)
    run_id, n = _record(settings, result, before, after, preset, cfg, model_path)
    return StepReport(
        result, run_id, n, before, after, settings.sqlalchemy_url, queries, cfg.shaping.lam
    )


def credit_records(result: StepResult, run_id: int | None, step: int) -> list[dict[str, Any]]:
    """Rows for the credit_records table, one per rollout."""
    credit, rows = result.credit, []
    g = result.base.shape[1]
    for i, r in enumerate(result.rollouts):
        rec = credit.record(i)
        m = len(rec["actions"])
        b, s = divmod(i, g)
        rows.append(
            {
                "run_id": run_id,
                "step": step,
                "query_id": rec["query_id"],
                "query_text": rec["query_text"],
                "sample_index": r.sample_index,
                "policy_version": r.policy_version,
                "actions": rec["actions"],
                "format_status": r.parsed.status,
                "value_table": rec["value_table"],
                "credits": rec["credits"],
                "baselines": rec["baselines"],
                "advantages": {
                    "base": float(result.base[b, s]),
                    "shaped": result.shaped[b, s, :m].tolist(),
                },
                "value_full": rec["value_full"],
                "efficiency_residual": rec["efficiency_residual"],
                "index_version": rec["index_version"],
                "embedder_version": rec["embedder_version"],
                "evaluator_name": rec["evaluator_name"],
                "evaluator_version": rec["evaluator_version"],
                "cache_stats": {k: v for k, v in credit.cache.items() if k != "totals"},
                "anchor_query": rec["anchor_query"],
            }
        )
    return rows


def _record(
    settings: Settings,
    result: StepResult,
    before: str,
    after: str,
    preset: str,
    cfg: StepConfig,
    model_path: str,
) -> tuple[int, int]:
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.sqlalchemy_url)
    engine = make_engine(settings.sqlalchemy_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            pv = repo.get_policy_version_by_version(session, before) or repo.add_policy_version(
                session,
                version=before,
                name="policy",
                base_model=model_path,
                path=model_path,
                kind="base",
            )
            run = repo.create_run(
                session,
                name=f"step-{preset}",
                preset=preset,
                config=_jsonable(dataclasses.asdict(cfg)),
                policy_version_id=pv.id,
            )
            repo.add_step_metrics(session, run.id, 0, result.metrics, accepted=None)
            rows = credit_records(result, run.id, 0)
            repo.add_credit_records(session, rows)
            repo.finish_run(session, run.id, status="finished", notes=f"policy {before} -> {after}")
            return run.id, len(rows)
    finally:
        engine.dispose()


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj
