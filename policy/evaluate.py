"""Held-out evaluation of a rewrite policy: does query + rewrites retrieve better than the query?

Read :func:`evaluate_policy`. For each held-out query the policy writes m rewrites greedily in
one generation; every rewrite and the query run once through the (cached) executor at depth
``k_recall``; three merged lists are scored against qrels, the same merge the credit game uses
(union, each document at its best score, sorted):

- ``query``: the query's own list — the baseline a user already has;
- ``rewrites``: the rewrites' lists merged, without the query;
- ``combined``: query + rewrites — what CASI serves.

Metrics (means over queries): nDCG@10 and recall@100 of each list, the gain of ``combined`` over
``query``, the well-formed fraction (exactly m numbered rewrites; 1 by construction under the
constrained format) and the duplicate rate. Rewrites are greedy in float32 whatever precision
the training sampler uses: this is the one held-out path (`casi eval`, `casi train`'s
evaluations and the experiment's start all come here). The top 10 of a merge of
top-100 lists equals the top 10 of the merge of top-10 lists, so ``combined`` nDCG@10 is exactly
the training reward v(N) of the anchored game for those rewrites.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from evaluator.actions import ActionExecutor
from evaluator.coalitions import coalition_lists
from evaluator.scorers import SetScorer
from policy.rollout import Rollout, RolloutConfig, sample_rollouts
from policy.sampler import SamplerConfig

LISTS = ("query", "rewrites", "combined")


EVAL_SPLITS = ("test", "val", "train")


@dataclass(frozen=True)
class HeldOutConfig:
    """When a training run evaluates held-out and on what (`TrainConfig.eval`)."""

    every: int = 0
    """Held-out evaluation every N steps (0 = only before and after the run, if eval_queries > 0)."""
    queries: int = 0
    """Held-out claims in each evaluation (the first N of the split); 0 = none."""
    split: str = "test"
    """Split of the held-out evaluation: test (report) | val (the validation slice of TRAIN:
    choose hyperparameters there) | train."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.queries < 0:
            raise ValueError("eval_every and eval_queries must be >= 0")
        if self.split not in EVAL_SPLITS:
            raise ValueError(f"eval_split must be one of {list(EVAL_SPLITS)}, got {self.split!r}")


@dataclass(frozen=True)
class EvalConfig:
    """How the held-out evaluation generates (greedy, the run's rollout shape) and cuts lists."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    precision: str = "float32"  # held-out numbers are float32 greedy (bf16 moves them)
    batch_size: int = 32
    k_ndcg: int = 10
    k_recall: int = 100

    def __post_init__(self) -> None:
        if not 1 <= self.k_ndcg <= self.k_recall:
            raise ValueError(f"need 1 <= k_ndcg <= k_recall, got {self.k_ndcg}, {self.k_recall}")


@dataclass
class EvalResult:
    """Means over the held-out queries, and one row per query."""

    n_queries: int
    metrics: dict[str, float]
    per_query: list[dict[str, Any]] = field(default_factory=list)


def evaluate_policy(
    model: nn.Module,
    tokenizer: Any,
    queries: Sequence[tuple[str, str]],
    executor: ActionExecutor,
    ndcg: SetScorer,
    recall: SetScorer,
    cfg: EvalConfig,
) -> EvalResult:
    """Greedy rewrites for ``queries`` = [(id, text)], scored as query / rewrites / combined.

    ``executor`` must retrieve at depth ≥ ``cfg.k_recall``; ``ndcg`` and ``recall`` are replay
    scorers (nDCG@k_ndcg, recall@k_recall) over the split's qrels.
    """
    if not queries:
        raise ValueError("evaluate_policy needs at least one query")
    if executor.k < cfg.k_recall:
        raise ValueError(
            f"the executor retrieves {executor.k} documents; recall@{cfg.k_recall} needs more"
        )
    shape = cfg.rollout
    sampler = SamplerConfig(
        max_new_tokens=shape.response_cap,
        do_sample=False,
        precision=cfg.precision,
        batch_size=cfg.batch_size,
    )
    rollouts = sample_rollouts(
        model, tokenizer, [t for _, t in queries], 1, shape.n_actions, sampler,
        policy_version="eval", query_ids=[q for q, _ in queries], prompt_style=shape.prompt,
        format=shape.format, line_cap=shape.line_cap,
    )  # fmt: skip
    rewrites = [r.action_texts for r in rollouts]
    lists = _merged_lists(executor, [t for _, t in queries], rewrites, cfg)  # (Q, 3, k_recall)
    qids = [q for q, _ in queries]
    no_emb = torch.zeros(len(qids), 0)
    n = ndcg.score(qids, no_emb, lists[..., : cfg.k_ndcg]).double()  # (Q, 3)
    r = recall.score(qids, no_emb, lists).double()
    metrics: dict[str, float] = {}
    for i, name in enumerate(LISTS):
        metrics[f"{name}_ndcg@{cfg.k_ndcg}"] = float(n[:, i].mean())
        metrics[f"{name}_recall@{cfg.k_recall}"] = float(r[:, i].mean())
    metrics[f"gain_ndcg@{cfg.k_ndcg}"] = float((n[:, 2] - n[:, 0]).mean())
    metrics[f"gain_recall@{cfg.k_recall}"] = float((r[:, 2] - r[:, 0]).mean())
    metrics["well_formed"] = sum(ro.parsed.status == "ok" for ro in rollouts) / len(rollouts)
    metrics["duplicate_rate"] = duplicate_rate(rollouts)
    per_query = [
        {"query_id": q, "rewrites": rw, "status": ro.parsed.status,
         "ndcg": n[i].tolist(), "recall": r[i].tolist()}
        for i, (q, rw, ro) in enumerate(zip(qids, rewrites, rollouts, strict=True))
    ]  # fmt: skip
    return EvalResult(len(queries), metrics, per_query)


def duplicate_rate(rollouts: Sequence[Rollout]) -> float:
    """Share of actions that exactly repeat an earlier action of the same generation
    (case- and whitespace-insensitive; they stay separate players)."""
    actions = [a for r in rollouts for a in r.actions]
    return sum(a.duplicate_of is not None for a in actions) / max(len(actions), 1)


def _merged_lists(
    executor: ActionExecutor, queries: list[str], rewrites: list[list[str]], cfg: EvalConfig
) -> torch.Tensor:
    """(Q, 3, k_recall) rows: the query's list, the rewrites merged, query + rewrites merged."""
    width = max(1, max(len(r) for r in rewrites))
    n_act = [len(r) for r in rewrites]
    batch = executor.run([a for r in rewrites for a in r] + queries)  # ONE cached batch
    k = batch.rows.shape[1]
    rows = torch.full((len(queries), width, k), -1, dtype=torch.long)
    scores = torch.zeros((len(queries), width, k), dtype=torch.float32)
    pos = 0
    for i, m in enumerate(n_act):
        rows[i, :m] = torch.from_numpy(batch.rows[pos : pos + m])
        scores[i, :m] = torch.from_numpy(batch.scores[pos : pos + m])
        pos += m
    q_rows = torch.from_numpy(batch.rows[pos:])
    q_scores = torch.from_numpy(batch.scores[pos:])
    counts = torch.tensor(n_act, dtype=torch.long)
    rule: dict[str, Any] = {
        "merge": executor.merge,
        "rrf_k": executor.rrf_k,
    }  # the credit game's merge rule
    plain = coalition_lists(rows, scores, counts, cfg.k_recall, **rule).doc_idx  # (Q, 2^M, K)
    anchored = coalition_lists(
        rows, scores, counts, cfg.k_recall, anchor_idx=q_rows, anchor_scores=q_scores, **rule
    ).doc_idx
    return torch.stack([anchored[:, 0], plain[:, -1], anchored[:, -1]], dim=1)
