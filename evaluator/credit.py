"""THE credit path: actions → coalition lists → values → Shapley credit and baselines.

Read first: :func:`compute_credits`. The trainer and ``POST /v1/credits`` both call it, so a
credit printed by the CLI, stored by the API and used by the learner are the same numbers.

For R rollouts with m_r ≤ MAX_PLAYERS (12) actions (8 is the largest the experiments use: 256 coalitions) each (padded to M = max m_r with empty actions, which
are null players and so change no real action's credit):

1. every action runs once through the Redis-cached executor (one batch for all rollouts; with
   the anchor on, each distinct user query runs in the same batch);
2. the coalition engine rebuilds the merged top-K list of all 2^M coalitions from the cache,
   under the merge rule ``max`` or ``rrf`` (default: the executor's, i.e. its retriever's:
   ``max`` for dense, ``rrf`` for bm25) (anchor on: the query's own list R_0 is in every
   coalition, so v(∅) = the query alone and φ_j is what rewrite j adds beyond the query;
   anchor off: v(∅) = E(empty list));
3. the frozen evaluator scores all R·2^M lists in one batched call;
4. exact Shapley (one matmul) + baselines, with the efficiency residual checked.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from evaluator.actions import ActionBatch, ActionExecutor
from evaluator.coalitions import CoalitionLists, coalition_lists
from evaluator.scorers import SetScorer
from evaluator.shapley import (
    MAX_PLAYERS,
    broadcast,
    efficiency_residual,
    exact_shapley,
    leave_one_out,
    shapley_interaction,
    singleton,
)

# Efficiency Σφ = v(N) − v(∅) must hold to this in float64, relative to the game's scale
# (docs/methods.md §1): a game's tolerance is EFFICIENCY_TOL · max(1, max_S |v(S)|).
EFFICIENCY_TOL = 1e-9


def efficiency_violations(values: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """(R,) bool: the games whose value table is non-finite or whose |efficiency residual|
    exceeds EFFICIENCY_TOL · max(1, max_S |v(S)|) (relative: rounding grows with |v|, so a game
    of nDCG values in [0, 1] is held to 1e-9 and a game of values near 1e8 to 0.1)."""
    finite = torch.isfinite(values).all(dim=-1)
    scale = values.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=-1).clamp(min=1.0)
    return ~finite | ~(residual.abs() <= EFFICIENCY_TOL * scale)


@dataclass(frozen=True)
class RolloutActions:
    """One rollout's query and the rewrites (players) it produced."""

    query_id: str
    query_text: str
    actions: list[str]


@dataclass
class CreditResult:
    """Credits of a batch of rollouts; tensors are on CPU, float64, padded to M actions."""

    rollouts: list[RolloutActions]
    n_actions: torch.Tensor  # (R,) int64
    values: torch.Tensor  # (R, 2^M) v(S) by bitmask
    phi: torch.Tensor  # (R, M) exact Shapley; 0 at padding
    singleton: torch.Tensor  # (R, M) v({j}) − v(∅)
    leave_one_out: torch.Tensor  # (R, M) v(N) − v(N∖{j})
    broadcast: torch.Tensor  # (R, M) v(N) for every real action
    residual: torch.Tensor  # (R,) Σφ − (v(N) − v(∅))
    lists: CoalitionLists
    action_rows: torch.Tensor  # (R, M, k) retrieved rows per action, −1 padded
    versions: dict[str, str]
    cache: dict[str, Any]
    anchor_query: bool = False  # the query's own list is in every coalition (v(∅) = query alone)
    interaction: torch.Tensor | None = None  # (R, M, M) when requested
    extra: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # wall seconds: actions, credit
    merge: str = "max"  # how the coalition lists were merged: "max" | "rrf" | "pool"
    rrf_k: float = 60.0  # the rrf constant (unused under "max")
    anchor_rows: torch.Tensor | None = None  # (R, k) the query's own list (anchor on), −1 padded

    @property
    def value_full(self) -> torch.Tensor:
        """(R,) v(N) — the rollout's reward."""
        return self.values[:, -1]

    @property
    def value_empty(self) -> torch.Tensor:
        """(R,) v(∅) — with the anchor on, the query alone; v(N) − v(∅) is the rewriting gain."""
        return self.values[:, 0]

    def record(self, i: int) -> dict[str, Any]:
        """Rollout ``i`` as plain Python (its own 2^{m_i} table, its m_i credits)."""
        m = int(self.n_actions[i])
        return {
            "query_id": self.rollouts[i].query_id,
            "query_text": self.rollouts[i].query_text,
            "actions": list(self.rollouts[i].actions),
            "value_table": self.values[i, : 2**m].tolist(),
            "value_full": float(self.values[i, -1]),
            "credits": self.phi[i, :m].tolist(),
            "baselines": {
                "singleton": self.singleton[i, :m].tolist(),
                "leave_one_out": self.leave_one_out[i, :m].tolist(),
                "broadcast": self.broadcast[i, :m].tolist(),
            },
            "efficiency_residual": float(self.residual[i]),
            "action_rows": self.action_rows[i, :m].tolist(),
            "anchor_rows": None if self.anchor_rows is None else self.anchor_rows[i].tolist(),
            "anchor_query": self.anchor_query,
            "merge": self.merge,
            **self.versions,
        }


def _pad_actions(
    n_actions: Sequence[int], rows: np.ndarray, scores: np.ndarray, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter the flat (Σm, k) action results into (R, M, k), padding with empty actions."""
    r_count, k = len(n_actions), rows.shape[1]
    out_rows = np.full((r_count, width, k), -1, dtype=np.int64)
    out_scores = np.zeros((r_count, width, k), dtype=np.float32)
    owner = np.repeat(np.arange(r_count), n_actions)  # (Σm,)
    slot = np.arange(len(owner)) - np.repeat(
        np.cumsum(n_actions) - np.asarray(n_actions), n_actions
    )
    out_rows[owner, slot] = rows
    out_scores[owner, slot] = np.where(rows >= 0, scores, 0.0)
    return torch.from_numpy(out_rows), torch.from_numpy(out_scores)


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(rows, dim=0, return_inverse=True)`` up to row order, ~10× faster: rows are
    grouped by a 64-bit multiplicative hash (1-D unique), then checked exactly; on a collision
    (never seen, but possible) it falls back to the lexicographic ``unique(dim=0)``."""
    gen = torch.Generator().manual_seed(rows.shape[1])
    mult = (torch.randint(1, 2**62, (rows.shape[1],), generator=gen) * 2 + 1).to(rows.device)
    hashed = (rows * mult).sum(-1)  # (n,) int64, wrapping arithmetic
    _, inverse = torch.unique(hashed, return_inverse=True)
    first = torch.empty(
        int(inverse.max()) + 1 if inverse.numel() else 0, dtype=torch.long, device=rows.device
    )
    first.scatter_(
        0, inverse, torch.arange(rows.shape[0], device=rows.device)
    )  # a representative row
    uniq = rows[first]
    if not torch.equal(uniq[inverse], rows):
        uniq, inverse = torch.unique(rows, dim=0, return_inverse=True)
    return uniq, inverse


@dataclass
class EvaluatorCredit:
    """Another evaluator's game on the SAME coalition lists: ``CreditResult.extra[name]``
    (tensors (R, 2^M) / (R, M) / (R,) as in :class:`CreditResult`; 0 at padded actions)."""

    name: str
    version: str
    values: torch.Tensor  # (R, 2^M)
    phi: torch.Tensor  # (R, M)
    singleton: torch.Tensor  # (R, M)
    leave_one_out: torch.Tensor  # (R, M)
    broadcast: torch.Tensor  # (R, M)
    residual: torch.Tensor  # (R,)


class _DistinctLists:
    """The distinct (query, list) pairs of a (R, 2^M, K) batch, shared by every scorer of a
    call: each scorer scores each distinct pair once; query embeddings are computed once."""

    def __init__(
        self, rollouts: Sequence[RolloutActions], executor: ActionExecutor, lists: torch.Tensor
    ) -> None:
        r_count, n_coal, k = lists.shape
        qids = sorted({r.query_id for r in rollouts})
        pos = {q: i for i, q in enumerate(qids)}
        qidx = torch.tensor([pos[r.query_id] for r in rollouts], device=lists.device)
        keyed = torch.cat([qidx[:, None, None].expand(r_count, n_coal, 1), lists], -1)
        self.uniq, self.inverse = distinct_rows(keyed.reshape(-1, k + 1))  # (U, K+1), (R·2^M,)
        self.query_ids = [qids[int(i)] for i in self.uniq[:, 0].tolist()]
        self.text_of = {r.query_id: r.query_text for r in rollouts}
        self.executor, self.shape = executor, (r_count, n_coal)
        self._emb: torch.Tensor | None = None

    def query_emb(self) -> torch.Tensor:
        """(U, d) embeddings of each distinct pair's query (embedded once per call)."""
        if self._emb is None:
            texts = [self.text_of[q] for q in self.query_ids]
            self._emb = torch.from_numpy(self.executor.embed_queries(texts)).to(self.uniq.device)
        return self._emb

    def score(self, scorer: SetScorer) -> torch.Tensor:
        """v of every (rollout, coalition) list → (R, 2^M) float64 on CPU."""
        emb = (
            self.query_emb()
            if scorer.uses_query_emb
            else torch.zeros(len(self.query_ids), 0, device=self.uniq.device)
        )
        values = scorer.score(self.query_ids, emb, self.uniq[:, None, 1:]).double().cpu()  # (U, 1)
        return values[:, 0][self.inverse.cpu()].reshape(self.shape)


def _score_distinct(
    scorer: SetScorer,
    rollouts: Sequence[RolloutActions],
    executor: ActionExecutor,
    lists: torch.Tensor,
) -> torch.Tensor:
    """v of every (rollout, coalition) list, scoring each distinct (query, list) pair once.

    Many coalitions share a list (a redundant action adds nothing) and the G rollouts of a
    query share many: scoring distinct pairs only cuts a neural evaluator's work ~3×.
    """
    return _DistinctLists(rollouts, executor, lists).score(scorer)


def _game(
    scorer: SetScorer, values: torch.Tensor, width: int, real: torch.Tensor
) -> EvaluatorCredit:
    """Shapley φ and baselines of one evaluator's tables; efficiency checked (float64)."""
    phi = exact_shapley(values, width)  # (R, M)
    residual = efficiency_residual(values, phi)
    if bool(efficiency_violations(values, residual).any()):
        raise FloatingPointError(
            f"credit check failed ({scorer.name}): max |efficiency residual| "
            f"{float(residual.abs().max()):.3g}"
        )
    return EvaluatorCredit(
        scorer.name,
        scorer.version,
        values,
        phi * real,
        singleton(values, width) * real,
        leave_one_out(values, width) * real,
        broadcast(values, width) * real,
        residual,
    )


def _extra_games(
    distinct: _DistinctLists,
    scorers: Sequence[SetScorer],
    main: SetScorer,
    width: int,
    real: torch.Tensor,
) -> dict[str, EvaluatorCredit]:
    """The games of the extra scorers on the already built lists, keyed by scorer name."""
    names = [main.name, *(s.name for s in scorers)]
    if len(set(names)) != len(names):
        raise ValueError(f"extra_scorers need distinct names (and not the main one's): {names}")
    return {s.name: _game(s, distinct.score(s), width, real) for s in scorers}


def _anchor_lists(
    batch: ActionBatch,
    n_act: int,
    queries: Sequence[str],
    rollouts: Sequence[RolloutActions],
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rollout's query list (rows, scores) (R, k): the queries ran after the n_act rewrites."""
    pos = {q: n_act + i for i, q in enumerate(queries)}
    which = [pos[r.query_text] for r in rollouts]
    return (
        torch.from_numpy(batch.rows[which]).to(device),
        torch.from_numpy(batch.scores[which]).to(device),
    )


def compute_credits(
    rollouts: Sequence[RolloutActions],
    executor: ActionExecutor,
    scorer: SetScorer,
    list_k: int,
    *,
    device: torch.device | str = "cpu",
    with_interaction: bool = False,
    anchor_query: bool = True,
    n_players: int | None = None,
    extra_scorers: Sequence[SetScorer] = (),
    merge: str | None = None,
    rrf_k: float | None = None,
) -> CreditResult:
    """Credit every action of every rollout (see the module docstring for the steps).

    ``anchor_query`` (default on): the user's query is an anchor whose own top-k list is in
    every coalition (docs/methods.md §1); off = the plain game over the rewrites only.
    ``n_players``: pad every rollout to this many players (default: the largest m_r), so a
    trainer asking for m rewrites always gets (R, m) credits and (R, 2^m) tables.
    ``extra_scorers``: more evaluators scoring the SAME coalition lists (no second retrieval,
    no second list build); each one's game lands in ``result.extra[scorer.name]``
    (:class:`EvaluatorCredit`) — what the evaluator audit compares.
    ``merge`` (``"max"`` | ``"rrf"``) and ``rrf_k``: how coalition lists are merged; None takes
    the executor's (``executor.merge``: ``max`` for a dense index, ``rrf`` for bm25, unless the
    executor was built with another; ``executor.rrf_k``, default 60).
    """
    if not rollouts:
        raise ValueError("compute_credits needs at least one rollout")
    n_actions = [len(r.actions) for r in rollouts]
    if max(n_actions) > MAX_PLAYERS:
        raise ValueError(
            f"at most {MAX_PLAYERS} actions per rollout (exact Shapley is 2^m), got {max(n_actions)}"
        )
    width = n_players if n_players is not None else max(1, max(n_actions))
    if max(n_actions) > width:
        raise ValueError(f"a rollout has {max(n_actions)} actions but n_players is {width}")
    texts = [a for r in rollouts for a in r.actions]
    queries = sorted({r.query_text for r in rollouts}) if anchor_query else []
    t0 = time.perf_counter()
    batch = executor.run(texts + queries)  # ONE cached batch: every rewrite (+ every query)
    t_actions = time.perf_counter() - t0
    n_act = len(texts)
    rows, scores = _pad_actions(
        n_actions, batch.rows[:n_act], batch.scores[:n_act], width
    )  # (R, M, k)
    counts = torch.tensor(n_actions, dtype=torch.int64)
    anchor_idx, anchor_scores = (
        _anchor_lists(batch, n_act, queries, rollouts, device) if anchor_query else (None, None)
    )
    merge = merge or executor.merge
    rrf_k = executor.rrf_k if rrf_k is None else float(rrf_k)
    lists = coalition_lists(
        rows.to(device), scores.to(device), counts.to(device), list_k,
        anchor_idx=anchor_idx, anchor_scores=anchor_scores, merge=merge, rrf_k=rrf_k,
    )  # fmt: skip
    distinct = _DistinctLists(rollouts, executor, lists.doc_idx)
    real = (torch.arange(width)[None, :] < counts[:, None]).double()  # (R, M) 1 at real actions
    game = _game(scorer, distinct.score(scorer), width, real)  # values (R, 2^M), φ (R, M)
    values = game.values
    timings = {"actions_s": t_actions, "credit_s": time.perf_counter() - t0 - t_actions}
    return CreditResult(
        rollouts=list(rollouts),
        n_actions=counts,
        values=values,
        phi=game.phi,
        singleton=game.singleton,
        leave_one_out=game.leave_one_out,
        broadcast=game.broadcast,
        residual=game.residual,
        lists=CoalitionLists(lists.doc_idx.cpu(), lists.scores.cpu(), counts),
        action_rows=rows,
        versions={
            "index_version": executor.index.version,
            "embedder_version": executor.retriever.encoder_version,
            "evaluator_name": scorer.name,
            "evaluator_version": scorer.version,
        },
        cache={
            "status": batch.cache_status,
            **batch.stats,
            "totals": executor.cache.stats.as_dict(),
        },
        anchor_query=anchor_query,
        interaction=shapley_interaction(values, width) * real[:, :, None] * real[:, None, :]
        if with_interaction
        else None,
        extra=dict(_extra_games(distinct, extra_scorers, scorer, width, real)),
        timings=timings,
        merge=merge,
        rrf_k=rrf_k,
        anchor_rows=None if anchor_idx is None else anchor_idx.cpu(),
    )
