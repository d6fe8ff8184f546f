"""The credit games by name, and the pooled game's closed form (docs/methods.md §1.4).

A *game* fixes what a coalition's value is; the credit path (:mod:`evaluator.credit`) plays any
of them with the same code. Read :data:`GAMES`, then :func:`coverage_shapley`.

- ``list`` (the default): a coalition's lists merged under the merge rule (``max`` or ``rrf``)
  and cut to K; v(S) = nDCG@K of that list (the ``replay`` scorer). What a user who reads the
  top of one fused list gets.
- ``pool`` (pooled candidates): every action retrieves its top k; a coalition's **pool** is the
  union of its lists, never cut (merge rule ``pool``); v(S) = **graded recall of the pool**,
  Σ_{d ∈ pool(S)} g(d) / Σ_d g(d) over the query's judged documents (``replay`` with
  ``graded_recall``). What a downstream ranker that sees every candidate can at best find. The
  query's own top k is the anchor, in every coalition (v(∅) = the query's own list).

The pooled game is a weighted coverage game, so its Shapley value has a closed form: with L_0
the anchor's list and n_d the number of actions whose list holds d,

    φ_j = Σ_{d ∈ L_j ∖ L_0} g(d) / n_d / G,        G = Σ_d g(d)

(each newly found document's value is split equally among the actions that found it). Copies
of one rewrite split what they find, singleton credit pays each copy in full, leave-one-out
pays them nothing. :func:`coverage_shapley` computes it straight from the action lists; the
tests hold the coalition engine + exact Shapley to it. :func:`pool_mechanics` gives the
held-out mechanism numbers of the same counts: overlap between the rewrites' lists and the
share of the gain that documents only one rewrite found bring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evaluator.retrievers import check_merge

__all__ = [
    "GAMES",
    "Game",
    "PoolCounts",
    "check_game",
    "coverage_shapley",
    "game_merge",
    "pool_counts",
    "pool_mechanics",
]


@dataclass(frozen=True)
class Game:
    """A credit game: how coalition lists are built (``merge``: None = the environment's rule,
    ``max`` or ``rrf``) and what the replay evaluator measures on them (``metric``)."""

    name: str
    merge: str | None
    metric: str
    description: str


GAMES: dict[str, Game] = {
    "list": Game("list", None, "ndcg", "the merged list cut to K, scored by nDCG@K"),
    "pool": Game(
        "pool", "pool", "graded_recall", "the union of the lists, scored by graded recall"
    ),
}
"""The games by name (``CASI_GAME``)."""


def check_game(name: str) -> Game:
    """The game ``name``, else ValueError listing the valid ones."""
    if name not in GAMES:
        raise ValueError(f"unknown game {name!r}; valid: {', '.join(GAMES)}")
    return GAMES[name]


def game_merge(name: str, merge: str) -> str:
    """The merge rule coalition lists get in game ``name`` when the environment asks for
    ``merge``: the ``pool`` game always pools; the ``list`` game takes ``max``/``rrf``."""
    game = check_game(name)
    check_merge(merge)
    if game.merge is not None:
        return game.merge
    if merge == "pool":
        raise ValueError("merge rule 'pool' is the pooled game's: use the game 'pool'")
    return merge


@dataclass(frozen=True)
class PoolCounts:
    """Per list entry of (R, M, k) action lists: ``new`` (a real entry the anchor's list lacks),
    ``n_found`` (how many real actions' lists hold that document; 0 at padding)."""

    new: torch.Tensor  # (R, M, k) bool
    n_found: torch.Tensor  # (R, M, k) int64


def pool_counts(
    rows: torch.Tensor, n_actions: torch.Tensor, anchor: torch.Tensor | None = None
) -> PoolCounts:
    """Who found what: ``rows`` (R, M, k) int64 action lists (−1 padding; actions j ≥
    ``n_actions[r]`` are padding), ``anchor`` (R, k) the query's own list or None.

    A retriever's list holds a document at most once, so n_d counts actions, not entries."""
    n_rollouts, width, k = rows.shape
    acting = torch.arange(width)[None, :] < n_actions[:, None]  # (R, M)
    real = (rows >= 0) & acting[:, :, None]  # (R, M, k)
    flat = torch.where(real, rows, -1).reshape(n_rollouts, width * k)  # (R, Mk)
    holds = (flat[:, :, None, None] == flat.reshape(n_rollouts, 1, width, k)).any(-1)  # (R, Mk, M)
    n_found = (holds & acting[:, None, :]).sum(-1).reshape(rows.shape) * real
    if anchor is None:
        new = real
    else:
        in_anchor = (flat[:, :, None] == anchor[:, None, :]).any(-1).reshape(rows.shape)
        new = real & ~in_anchor
    return PoolCounts(new, n_found)


def coverage_shapley(
    rows: torch.Tensor,
    n_actions: torch.Tensor,
    grades: torch.Tensor,
    grade_total: torch.Tensor,
    anchor: torch.Tensor | None = None,
) -> torch.Tensor:
    """The pooled game's Shapley values in closed form → (R, M) float64 (0 at padding).

    ``grades`` (R, M, k): the relevance grade of each entry for its rollout's query (0 if not
    relevant); ``grade_total`` (R,): Σ of the query's grades (> 0)."""
    counts = pool_counts(rows, n_actions, anchor)
    share = torch.where(
        counts.new, grades.double() / counts.n_found.clamp(min=1).double(), 0.0
    )  # (R, M, k)
    return share.sum(-1) / grade_total.double()[:, None]


def pool_mechanics(
    rows: torch.Tensor,
    n_actions: torch.Tensor,
    grades: torch.Tensor,
    anchor: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per rollout (R,) float64, of the rewrites' lists:

    - ``overlap``: the share of the distinct documents the rewrites found that two or more
      rewrites found (0 when they found none);
    - ``unique_gain_share``: the share of the gain (Σ g over documents the anchor lacks) that
      comes from documents exactly one rewrite found (NaN when there is no gain);
    - ``distinct``: the number of distinct documents the rewrites found.
    """
    counts = pool_counts(rows, n_actions, anchor)
    n = counts.n_found.double()
    weight = torch.where(n > 0, 1.0 / n.clamp(min=1), 0.0)  # Σ over a doc's entries = 1
    distinct = weight.sum((1, 2))
    shared = torch.where(n >= 2, weight, 0.0).sum((1, 2))
    gain_w = torch.where(counts.new, grades.double() * weight, 0.0)
    gain = gain_w.sum((1, 2))
    unique = torch.where(counts.new & (counts.n_found == 1), grades.double(), 0.0).sum((1, 2))
    return {
        "overlap": torch.where(distinct > 0, shared / distinct.clamp(min=1e-12), 0.0),
        "unique_gain_share": torch.where(gain > 0, unique / gain.clamp(min=1e-12), torch.nan),
        "distinct": distinct,
    }
