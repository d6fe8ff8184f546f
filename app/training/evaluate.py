"""The `casi eval` service: held-out retrieval of a policy version, stored in the database.

Read :func:`evaluate_and_store`. `build_eval_request` (`held_out_request` from a training
config) fixes WHAT is measured (the first N queries of a split; the credit game's executor,
``retrieval.executor``, whose depth, merge rule and rrf_k fuse the nDCG@10 lists as the game
and ``POST /v1/rewrites`` fuse them; a depth-100 executor of the same retriever for the
recall@100 lists; the replay scorers) once, so every evaluation of a run — and `casi eval`
afterwards — measures the same thing.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.runtime import Retrieval
from app.training.splits import qrels_split, split_ids
from evaluator.scorers import SetScorer, make_scorer
from policy.evaluate import EvalConfig, EvalResult, evaluate_policy
from policy.rollout import RolloutConfig

RECALL_DEPTH = 100


@dataclass
class EvalRequest:
    """What a held-out evaluation measures (built once per run)."""

    split: str
    queries: list[tuple[str, str]]
    executor: Any  # ActionExecutor of the credit game (its depth, merge rule, rrf_k)
    recall_executor: Any  # the same retriever at depth ≥ RECALL_DEPTH
    ndcg: SetScorer
    recall: SetScorer
    config: EvalConfig

    def describe(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "n_queries": len(self.queries),
            **dataclasses.asdict(self.config),
            "game_depth": self.executor.k,  # how the nDCG lists were fused
            "merge": self.executor.merge,
            "rrf_k": self.executor.rrf_k,
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
        executor=retrieval.executor,
        recall_executor=retrieval.executor_at(RECALL_DEPTH),
        ndcg=make_scorer("replay", qrels=qrels, k=config.k_ndcg),
        recall=make_scorer("replay", qrels=qrels, k=config.k_recall, metric="recall"),
        config=config,
    )


def held_out_request(
    retrieval: Retrieval, rollout: RolloutConfig, split: str, n_queries: int
) -> EvalRequest:
    """The held-out request of a rollout shape (a training config's ``rollout``, or `casi eval`'s
    options): its m, format, line cap, length cap and prompt; greedy float32 whatever the
    training sampler's precision (the one held-out path)."""
    return build_eval_request(retrieval, split, n_queries, EvalConfig(rollout=rollout))


ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "neon", "sve")
"""The CPU flags :func:`machine_info` keeps (the ones that change float kernels)."""


@functools.cache
def machine_info() -> dict[str, Any]:
    """The CPU model and its ISA flags (/proc/cpuinfo), core count and the kernel set torch
    dispatches to: recorded with every evaluation and experiment (float results can differ
    between machines in the last bits)."""
    model, flags = platform.processor() or platform.machine(), list[str]()
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = sorted(f for f in value.split() if f.startswith(ISA_PREFIXES))
    return {
        "cpu_model": model, "isa_flags": flags, "cpu_count": os.cpu_count(),
        "arch": platform.machine(), "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }  # fmt: skip


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
        recall_executor=request.recall_executor,
    )
    pv_id = register(result.metrics) if register is not None else policy_version_id
    if pv_id is None:
        raise ValueError("an evaluation must belong to a registered policy version")
    with session_scope(factory) as session:
        repo.add_evaluation(
            session, policy_version_id=pv_id, split=request.split, n_queries=result.n_queries,
            metrics=result.metrics, config={**request.describe(), "machine": machine_info()},
            run_id=run_id, step=step,
        )  # fmt: skip
    return result
