"""The `casi eval` service: held-out retrieval of a policy version, stored in the database.

Read :func:`evaluate_and_store`. `build_eval_request` fixes WHAT is measured (the first N
queries of a split, a depth-100 cached executor, the replay scorers for nDCG@10 and recall@100)
once, so every evaluation of a run — and `casi eval` afterwards — measures the same thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.runtime import Retrieval
from app.services.splits import qrels_split, split_ids
from evaluator.scorers import SetScorer, make_scorer
from policy.evaluate import EvalConfig, EvalResult, evaluate_policy

RECALL_DEPTH = 100


@dataclass
class EvalRequest:
    """What a held-out evaluation measures (built once per run)."""

    split: str
    queries: list[tuple[str, str]]
    executor: Any  # ActionExecutor at depth ≥ RECALL_DEPTH
    ndcg: SetScorer
    recall: SetScorer
    config: EvalConfig

    def describe(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "n_queries": len(self.queries),
            **dataclasses.asdict(self.config),
        }


def build_eval_request(
    retrieval: Retrieval, split: str, n_queries: int, config: EvalConfig
) -> EvalRequest:
    """The first ``n_queries`` judged queries of ``split`` (file order: deterministic)."""
    ids = split_ids(retrieval.dataset, split)
    if n_queries < 1:
        raise ValueError(f"--queries must be >= 1, got {n_queries}")
    if len(ids) < n_queries:
        raise ValueError(f"split {split!r} has {len(ids)} judged queries; asked for {n_queries}")
    ids = ids[:n_queries]
    qrels = retrieval.dataset.qrels_rows(qrels_split(split))
    return EvalRequest(
        split=split,
        queries=[(q, retrieval.dataset.queries[q]) for q in ids],
        executor=retrieval.executor_at(RECALL_DEPTH),
        ndcg=make_scorer("replay", qrels=qrels, k=config.k_ndcg),
        recall=make_scorer("replay", qrels=qrels, k=config.k_recall, metric="recall"),
        config=config,
    )


def evaluate_and_store(
    factory: sessionmaker[Session],
    model: Any,
    tokenizer: Any,
    request: EvalRequest,
    *,
    policy_version_id: int | None,
    run_id: int | None = None,
    step: int | None = None,
    register: Callable[[dict[str, float]], int] | None = None,
) -> EvalResult:
    """Evaluate, then store the result against ``policy_version_id`` (or the id ``register``
    returns once the metrics are known: a training run checkpoints the weights it evaluated)."""
    result = evaluate_policy(
        model,
        tokenizer,
        request.queries,
        request.executor,
        request.ndcg,
        request.recall,
        request.config,
    )
    pv_id = register(result.metrics) if register is not None else policy_version_id
    if pv_id is None:
        raise ValueError("an evaluation must belong to a registered policy version")
    with session_scope(factory) as session:
        repo.add_evaluation(
            session, policy_version_id=pv_id, split=request.split, n_queries=result.n_queries,
            metrics=result.metrics, config=request.describe(), run_id=run_id, step=step,
        )  # fmt: skip
    return result
