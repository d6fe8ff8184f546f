"""Held-out evaluation of a rewrite policy: does query + rewrites retrieve better than the query?

Read :func:`evaluate_policy`. For each held-out query the policy writes m rewrites greedily in
one generation; every rewrite and the query run through the (cached) executors, and three
fused lists are scored against qrels:

- ``query``: the query's own list — the baseline a user already has;
- ``rewrites``: the rewrites' lists fused, without the query;
- ``combined``: query + rewrites — what CASI serves.

nDCG@10 is computed on lists fused exactly as the credit game fuses them (:func:`_fused_lists`):
each list at the game's depth (the game executor's ``k``, i.e. retrieval_k), fused by the
coalition engine under the game's merge rule (the executor's ``merge`` and ``rrf_k``), cut to
10. So with the game's list_k = 10 (the default) ``query`` nDCG@10 is v(∅) and ``combined``
nDCG@10 is v(N) of the anchored replay game (nDCG@10 against the split's qrels) for those
rewrites, and ``combined`` is the list ``POST /v1/rewrites`` serves. recall@100 is computed on
separate depth-100 lists (the ``recall_executor``), fused under the same rule. The two depths
are kept apart because under ``rrf`` the top 10 of a fusion of depth-100 lists is not the fusion
of depth-10 lists: a document at rank 30 of two lists (2/90) outranks one at rank 1 of one list
(1/61), and documents no coalition of the game ever sees get ranked.

Metrics (means over queries): nDCG@10 and recall@100 of each list, the gain of ``combined`` over
``query``, the well-formed fraction (exactly m numbered rewrites; 1 by construction under the
constrained format) and the duplicate rate. Rewrites are greedy in float32 whatever precision
the training sampler uses: this is the one held-out path (`casi eval`, `casi train`'s
evaluations and the experiment's start all come here).
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
    k_ndcg: int = 10  # nDCG cut of the lists fused at the game's depth
    k_recall: int = 100  # depth of the recall lists (and their recall cut)

    def __post_init__(self) -> None:
        if not 1 <= self.k_ndcg <= self.k_recall:
            raise ValueError(f"need 1 <= k_ndcg <= k_recall, got {self.k_ndcg}, {self.k_recall}")


@dataclass(frozen=True)
class RankedLists:
    """Fused lists of the held-out queries, in :data:`LISTS` order on dim 1: ``rows`` (Q, 3, k)
    int64 index rows ranked best first (−1 = padding, always at the end) and ``scores``
    (Q, 3, k) float32, their fused scores (descending; ties kept in the engine's order, the
    smaller row first; 0 at padding): the best score under ``max``, Σ 1/(rrf_k + rank) under
    ``rrf``."""

    rows: torch.Tensor
    scores: torch.Tensor


@dataclass
class EvalResult:
    """Means over the held-out queries, and one row per query.

    ``lists``: the lists the metrics were computed on (query order as ``per_query``):
    ``"ndcg"``, the game's fusion cut to ``k_ndcg``; ``"recall"``, the depth-``k_recall``
    fusion (under ``rrf`` its top ``k_ndcg`` can differ from the ``"ndcg"`` lists)."""

    n_queries: int
    metrics: dict[str, float]
    per_query: list[dict[str, Any]] = field(default_factory=list)
    lists: dict[str, RankedLists] = field(default_factory=dict)


def evaluate_policy(
    model: nn.Module,
    tokenizer: Any,
    queries: Sequence[tuple[str, str]],
    executor: ActionExecutor,
    ndcg: SetScorer,
    recall: SetScorer,
    cfg: EvalConfig,
    *,
    recall_executor: ActionExecutor,
) -> EvalResult:
    """Greedy rewrites for ``queries`` = [(id, text)], scored as query / rewrites / combined.

    ``executor`` is the credit game's (the trainer's, ``retrieval.executor``): its depth, merge
    rule and rrf_k fuse the nDCG lists. ``recall_executor``: the same retriever at depth ≥
    ``cfg.k_recall``, whose lists are fused under the same rule for recall. ``ndcg`` and
    ``recall`` are replay scorers (nDCG@k_ndcg, recall@k_recall) over the split's qrels.
    """
    if not queries:
        raise ValueError("evaluate_policy needs at least one query")
    _check_executors(executor, recall_executor, cfg.k_recall)
    rollouts = _greedy_rollouts(model, tokenizer, queries, cfg)
    texts = [t for _, t in queries]
    rewrites = [r.action_texts for r in rollouts]
    rule: dict[str, Any] = {"merge": executor.merge, "rrf_k": executor.rrf_k}  # the game's rule
    game_lists = _fused_ranked(executor, texts, rewrites, cfg.k_ndcg, **rule)
    deep_lists = _fused_ranked(recall_executor, texts, rewrites, cfg.k_recall, **rule)
    game, deep = game_lists.rows, deep_lists.rows  # (Q, 3, k_ndcg), (Q, 3, k_recall)
    qids = [q for q, _ in queries]
    no_emb = torch.zeros(len(qids), 0)
    n = ndcg.score(qids, no_emb, game).double()  # (Q, 3)
    r = recall.score(qids, no_emb, deep).double()
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
    return EvalResult(
        len(queries), metrics, per_query, lists={"ndcg": game_lists, "recall": deep_lists}
    )


def _check_executors(game: ActionExecutor, deep: ActionExecutor, k_recall: int) -> None:
    """The recall executor must be the game's retriever, deep enough for recall@k_recall."""
    if deep.k < k_recall:
        raise ValueError(
            f"the recall executor retrieves {deep.k} documents; recall@{k_recall} needs more"
        )
    same = (game.retriever.version, game.retriever.encoder_version)
    if (deep.retriever.version, deep.retriever.encoder_version) != same:
        raise ValueError("the recall executor must use the credit game's retriever and index")


def _greedy_rollouts(
    model: nn.Module, tokenizer: Any, queries: Sequence[tuple[str, str]], cfg: EvalConfig
) -> list[Rollout]:
    """One greedy generation of m rewrites per query, in ``cfg.precision``."""
    shape = cfg.rollout
    sampler = SamplerConfig(
        max_new_tokens=shape.response_cap,
        do_sample=False,
        precision=cfg.precision,
        batch_size=cfg.batch_size,
    )
    return sample_rollouts(
        model, tokenizer, [t for _, t in queries], 1, shape.n_actions, sampler,
        policy_version="eval", query_ids=[q for q, _ in queries], prompt_style=shape.prompt,
        format=shape.format, line_cap=shape.line_cap,
    )  # fmt: skip


def duplicate_rate(rollouts: Sequence[Rollout]) -> float:
    """Share of actions that exactly repeat an earlier action of the same generation
    (case- and whitespace-insensitive; they stay separate players)."""
    actions = [a for r in rollouts for a in r.actions]
    return sum(a.duplicate_of is not None for a in actions) / max(len(actions), 1)


def _fused_lists(
    executor: ActionExecutor,
    queries: list[str],
    rewrites: list[list[str]],
    top_k: int,
    *,
    merge: str,
    rrf_k: float,
) -> torch.Tensor:
    """(Q, 3, top_k) rows: the query's list, the rewrites fused, query + rewrites fused.

    Every list is ``executor``'s (depth ``executor.k``), fused by the coalition engine under
    ``merge`` / ``rrf_k`` and cut to ``top_k``: row 0 is coalition ∅ and row 2 the grand
    coalition N of the anchored game (the query as anchor), row 1 N of the plain game.
    """
    return _fused_ranked(executor, queries, rewrites, top_k, merge=merge, rrf_k=rrf_k).rows


def _fused_ranked(
    executor: ActionExecutor,
    queries: list[str],
    rewrites: list[list[str]],
    top_k: int,
    *,
    merge: str,
    rrf_k: float,
) -> RankedLists:
    """:func:`_fused_lists` with the fused scores."""
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
    rule: dict[str, Any] = {"merge": merge, "rrf_k": rrf_k}
    plain = coalition_lists(rows, scores, counts, top_k, **rule)  # (Q, 2^M, top_k)
    anchored = coalition_lists(
        rows, scores, counts, top_k, anchor_idx=q_rows, anchor_scores=q_scores, **rule
    )

    def pick(a: torch.Tensor, p: torch.Tensor) -> torch.Tensor:  # ∅ anchored, N plain, N anchored
        return torch.stack([a[:, 0], p[:, -1], a[:, -1]], dim=1)

    return RankedLists(pick(anchored.doc_idx, plain.doc_idx), pick(anchored.scores, plain.scores))
