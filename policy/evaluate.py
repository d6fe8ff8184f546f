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
constrained format), the duplicate rate and the degenerate rate (rewrites that are strings of
repeats: `evaluator.text.degenerate`).

In the pooled game (the game executor's merge rule is ``pool``; :class:`PoolEval`) the lists
above are pools, nDCG@10 is that of the pool's head under the game's fusion, and the evaluation adds
the game's own numbers (:func:`_pool_metrics`): the graded recall of each pool (``combined`` is
v(N), the primary number), the equal-budget baseline (the query alone at depth (m + 1)·k), the
keyword-expansion baseline (:mod:`evaluator.prf`) scored the same way, and the mechanism: the
overlap between the rewrites' lists and the share of the gain that documents only one rewrite
found bring (:func:`evaluator.games.pool_mechanics`); on a BM25 index also the served list's
nDCG@10 (``served_ndcg@10``: the pool re-ranked by the second stage, `evaluator.rerank`) and
keyword expansion's. A ``feedback`` prompt reads each query's context from ``feedback`` (the
game's `evaluator.feedback.FeedbackContext`). Rewrites are greedy in float32 whatever precision
the training sampler uses: this is the one held-out path (`casi eval`, `casi train`'s
evaluations and the experiment's start all come here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from evaluator.actions import ActionExecutor
from evaluator.coalitions import coalition_lists
from evaluator.games import pool_mechanics
from evaluator.rerank import PoolReranker
from evaluator.scorers import SetScorer
from evaluator.scorers.qrels import QrelsTable
from evaluator.text import degenerate
from policy.prompts import ContextSource
from policy.rollout import Rollout, RolloutConfig, contexts_for, sample_rollouts
from policy.sampler import SamplerConfig

LISTS = ("query", "rewrites", "combined")


EVAL_SPLITS = ("test", "val", "dev", "train")


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
    refuse_degenerate: bool = False
    """Decode the held-out rewrites as serving does: greedy with the degenerate guard, so no
    line is a string of repeats (constrained format; docs/methods.md §1.10). Off: they are
    scored as the policy writes them."""

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
    refuse_degenerate: bool = False
    """Greedy decoding's degenerate guard (constrained format; methods §1.10), as serving
    decodes; off for the committed protocols, which score rewrites as written."""

    def __post_init__(self) -> None:
        if not 1 <= self.k_ndcg <= self.k_recall:
            raise ValueError(f"need 1 <= k_ndcg <= k_recall, got {self.k_ndcg}, {self.k_recall}")


@dataclass(frozen=True)
class PoolEval:
    """What the pooled game's held-out numbers need beside the lists (:func:`_pool_metrics`)."""

    scorer: SetScorer
    """Graded recall of a whole pool (a replay scorer whose cut no pool reaches)."""
    qrels: QrelsTable
    """The split's judgments: each found document's grade, for the mechanism numbers."""
    budget_executor: ActionExecutor
    """The game's retriever at depth (m + 1)·k: the query alone with the whole budget."""
    baseline: Sequence[Sequence[str]]
    """The keyword-expansion rewrites of each held-out query (evaluation order)."""
    reranker: PoolReranker | None = None
    """The served second stage (`evaluator.rerank`; BM25 games): the pool re-ranked by the query
    and the rewrites' words, whose nDCG@k_ndcg is the served number (``served_ndcg@10``)."""


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
    pool: PoolEval | None = None,
    feedback: ContextSource | None = None,
) -> EvalResult:
    """Greedy rewrites for ``queries`` = [(id, text)], scored as query / rewrites / combined.

    ``executor`` is the credit game's (the trainer's, ``retrieval.executor``): its depth, merge
    rule and rrf_k fuse the nDCG lists. ``recall_executor``: the same retriever at depth ≥
    ``cfg.k_recall``, whose lists are fused under the same rule for recall. ``ndcg`` and
    ``recall`` are replay scorers (nDCG@k_ndcg, recall@k_recall) over the split's qrels.
    ``pool``: the pooled game's extras (required when the game executor merges by ``pool``).
    ``feedback``: the game's feedback context source (required by the ``feedback`` prompt).
    """
    if not queries:
        raise ValueError("evaluate_policy needs at least one query")
    _check_executors(executor, recall_executor, cfg.k_recall)
    if (executor.merge == "pool") != (pool is not None):  # before minutes of decoding
        raise ValueError("the pooled game's evaluation needs PoolEval, and only it takes one")
    contexts = contexts_for(cfg.rollout, feedback, [t for _, t in queries])  # before decoding
    rollouts = _greedy_rollouts(model, tokenizer, queries, cfg, contexts)
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
    metrics["degenerate_rate"] = degenerate_rate(rollouts)
    per_query = [
        {"query_id": q, "rewrites": rw, "status": ro.parsed.status,
         "ndcg": n[i].tolist(), "recall": r[i].tolist()}
        for i, (q, rw, ro) in enumerate(zip(qids, rewrites, rollouts, strict=True))
    ]  # fmt: skip
    if pool is not None:
        metrics.update(_pool_metrics(executor, texts, rewrites, qids, game, ndcg, pool, per_query))
    return EvalResult(
        len(queries), metrics, per_query, lists={"ndcg": game_lists, "recall": deep_lists}
    )


def _pool_metrics(
    executor: ActionExecutor,
    texts: list[str],
    rewrites: list[list[str]],
    qids: list[str],
    pools: torch.Tensor,
    ndcg: SetScorer,
    pool: PoolEval,
    per_query: list[dict[str, Any]],
) -> dict[str, float]:
    """The pooled game's held-out numbers; each query's go into its ``per_query`` row too.

    ``pools`` (Q, 3, W): the game's lists, i.e. the query's own list, the rewrites' pool and
    query + rewrites' pool."""
    no_emb = torch.zeros(len(qids), 0)
    recall = pool.scorer.score(qids, no_emb, pools).double()  # (Q, 3)
    deep = torch.from_numpy(pool.budget_executor.run(texts).rows)  # (Q, (m + 1)·k)
    budget = pool.scorer.score(qids, no_emb, deep[:, None]).double()[:, 0]
    base = _fused_ranked(
        executor, texts, [list(b) for b in pool.baseline], 1, merge="pool", rrf_k=executor.rrf_k
    ).rows
    base_recall = pool.scorer.score(qids, no_emb, base[:, 2:]).double()[:, 0]
    base_ndcg = ndcg.score(qids, no_emb, base[:, 2:]).double()[:, 0]
    served = prf_served = None
    if pool.reranker is not None:  # the served second stage on both pools
        served = _served_ndcg(pool.reranker, ndcg, texts, rewrites, qids, pools[:, 2])
        baseline = [list(b) for b in pool.baseline]
        prf_served = _served_ndcg(pool.reranker, ndcg, texts, baseline, qids, base[:, 2])
    mech = _mechanics(executor, texts, rewrites, qids, pool.qrels)
    base_mech = _mechanics(executor, texts, [list(b) for b in pool.baseline], qids, pool.qrels)
    for i, row in enumerate(per_query):
        share = float(mech["unique_gain_share"][i])
        row.update(pool=recall[i].tolist(), budget=float(budget[i]), prf=float(base_recall[i]),
                   prf_ndcg=float(base_ndcg[i]), overlap=float(mech["overlap"][i]),
                   unique_gain_share=None if math.isnan(share) else share)  # fmt: skip
        if served is not None and prf_served is not None:
            row.update(served_ndcg=float(served[i]), prf_served_ndcg=float(prf_served[i]))
    metrics = {f"{name}_pool_recall": float(recall[:, i].mean()) for i, name in enumerate(LISTS)}
    unique = mech["unique_gain_share"]
    metrics.update({
        "gain_pool_recall": float((recall[:, 2] - recall[:, 0]).mean()),
        "budget_pool_recall": float(budget.mean()), "prf_pool_recall": float(base_recall.mean()),
        "prf_ndcg@10": float(base_ndcg.mean()), "overlap": float(mech["overlap"].mean()),
        "prf_overlap": float(base_mech["overlap"].mean()),
        "unique_gain_share": float(unique.nanmean()) if bool((~unique.isnan()).any()) else 0.0,
        "distinct_found": float(mech["distinct"].mean()),
    })  # fmt: skip
    if served is not None and prf_served is not None:
        metrics["served_ndcg@10"] = float(served.mean())
        metrics["prf_served_ndcg@10"] = float(prf_served.mean())
    return metrics


def _served_ndcg(
    reranker: PoolReranker,
    ndcg: SetScorer,
    texts: list[str],
    rewrites: list[list[str]],
    qids: list[str],
    pools: torch.Tensor,
) -> torch.Tensor:
    """(Q,) nDCG of each pool (Q, W) as served: re-ranked by the second stage, then cut."""
    rows, _ = reranker.rerank(texts, rewrites, pools.numpy())
    served = torch.from_numpy(rows)[:, None]  # (Q, 1, W)
    return ndcg.score(qids, torch.zeros(len(qids), 0), served).double()[:, 0]


def _mechanics(
    executor: ActionExecutor,
    texts: list[str],
    rewrites: list[list[str]],
    qids: list[str],
    qrels: QrelsTable,
) -> dict[str, torch.Tensor]:
    """:func:`evaluator.games.pool_mechanics` of each query's rewrites (query list = anchor)."""
    rows, _, counts, anchor, _ = _action_lists(executor, texts, rewrites)
    qidx = qrels.indices(qids, allow_unjudged=True)
    grades = qrels.grades_at(qidx.repeat_interleave(rows[0].numel()), rows.reshape(-1, 1))
    return pool_mechanics(rows, counts, grades.reshape(rows.shape), anchor)


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
    model: nn.Module,
    tokenizer: Any,
    queries: Sequence[tuple[str, str]],
    cfg: EvalConfig,
    contexts: list[str] | None = None,
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
        format=shape.format, line_cap=shape.line_cap, contexts=contexts,
        refuse_degenerate=cfg.refuse_degenerate,
    )  # fmt: skip


def duplicate_rate(rollouts: Sequence[Rollout]) -> float:
    """Share of actions that exactly repeat an earlier action of the same generation
    (case- and whitespace-insensitive; they stay separate players)."""
    actions = [a for r in rollouts for a in r.actions]
    return sum(a.duplicate_of is not None for a in actions) / max(len(actions), 1)


def degenerate_rate(rollouts: Sequence[Rollout]) -> float:
    """Share of actions that are strings of repeats (`evaluator.text.degenerate`)."""
    actions = [a.text for r in rollouts for a in r.actions]
    return sum(degenerate(a) for a in actions) / max(len(actions), 1)


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


def _action_lists(
    executor: ActionExecutor, queries: list[str], rewrites: list[list[str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rewrite and query through ``executor`` in ONE cached batch: the rewrites' rows and
    scores (Q, M, k) (−1 / 0 padded to the most rewrites), their counts (Q,), and the queries'
    own rows and scores (Q, k)."""
    width = max(1, max(len(r) for r in rewrites))
    n_act = [len(r) for r in rewrites]
    batch = executor.run([a for r in rewrites for a in r] + queries)
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
    return rows, scores, torch.tensor(n_act, dtype=torch.long), q_rows, q_scores


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
    rows, scores, counts, q_rows, q_scores = _action_lists(executor, queries, rewrites)
    rule: dict[str, Any] = {"merge": merge, "rrf_k": rrf_k}
    plain = coalition_lists(rows, scores, counts, top_k, **rule)  # (Q, 2^M, top_k)
    anchored = coalition_lists(
        rows, scores, counts, top_k, anchor_idx=q_rows, anchor_scores=q_scores, **rule
    )

    def pick(a: torch.Tensor, p: torch.Tensor, pad: float) -> torch.Tensor:
        """∅ anchored, N plain, N anchored; a pool without the anchor is narrower: padded."""
        p = torch.nn.functional.pad(p, (0, a.shape[-1] - p.shape[-1]), value=pad)
        return torch.stack([a[:, 0], p[:, -1], a[:, -1]], dim=1)

    return RankedLists(
        pick(anchored.doc_idx, plain.doc_idx, -1), pick(anchored.scores, plain.scores, 0.0)
    )
