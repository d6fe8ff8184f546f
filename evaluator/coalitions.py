"""Snapshot set intervention: the merged top-K list of every coalition of actions (docs/methods.md §1).

One generation gives actions ``a_0..a_{M-1}``; each ran once and its top-k result list is
cached. For every coalition ``S ⊆ {0..M−1}`` (bitmask, bit j = action j) the coalition's list
is rebuilt from that cache only: the union of the lists of the actions in ``S``, each document
scored by the coalition's **merge rule**, sorted by that score descending, truncated to ``K``:

- ``max`` (dense default): a document's best retrieval score across the actions of ``S``;
- ``rrf`` (reciprocal-rank fusion, bm25 default): ``Σ_{j∈S} 1/(rrf_k + rank_j(d))`` over the
  actions whose list holds ``d``, ``rank_j`` 1-based: the position of ``d`` among the real
  (non-padding) entries of action ``j``'s list, which is in rank order as retrievers return it
  (the scores themselves are not used). A document found by several actions rises: under
  ``rrf`` actions interact, under ``max`` a document's score never depends on who else found it;
- ``pool`` (the pooled-candidates game, :mod:`evaluator.games`): the UNION of the coalition's
  lists, never truncated (``top_k`` is ignored: the width is every candidate, M·k, (M + 1)·k
  with the anchor), ranked as ``rrf`` ranks it, so its head is the served fusion.

Read :func:`coalition_lists` first. It is vectorized over (rollouts × coalitions):

1. every rollout's ``M·k`` candidate entries get a local vocabulary slot by one sort of the
   document ids (equal documents share a slot; slots increase with the document id);
2. each action's score per slot, ``(R, M, V)``, by one ``scatter_reduce(amax)`` (its best
   retrieval score under ``max``, its reciprocal rank under ``rrf``);
3. all ``2**M`` coalitions by subset doubling, ``M`` vectorized steps: the coalitions with bit
   ``j`` set are the ones without it, max-ed (``max``) or summed (``rrf``) with action ``j``'s
   scores;
4. one stable descending sort per (rollout, coalition) ranks the slots.

Tie-breaking is deterministic and the same under both rules: equal scores rank the smaller
document id first (step 4 is a stable sort, and slots are in ascending document order). ``rrf``
sums are float64 and accumulate in a fixed order (the anchor, then actions in ascending j, as
the doubling adds them), so "equal" means bitwise equal in that order.

**Anchor** (docs/methods.md §1, "the query as an anchor player"): with ``anchor_idx``/``anchor_scores``
(the user query's own top-k list ``R_0``, one per rollout), ``R_0`` is in every coalition's
list: coalition ∅ is ``R_0`` alone and step 3 starts from it instead of from nothing. The
anchor is not a player (there is no bit for it). Padded actions
(``j ≥ n_actions[r]``) and padded entries (``doc_idx == −1``) contribute nothing, so padded
actions are null players. Memory is bounded by processing rollouts in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evaluator.retrievers import DEFAULT_RRF_K, MERGE_RULES, check_merge
from evaluator.shapley import MAX_PLAYERS, coalition_masks, coalition_sizes

__all__ = [
    "DEFAULT_RRF_K",
    "MAX_CHUNK_ELEMENTS",
    "MERGE_RULES",
    "PAD_DOC",
    "PAD_SCORE",
    "CoalitionLists",
    "coalition_lists",
    "coalition_masks",
    "coalition_sizes",
]

PAD_DOC = -1
"""Document id of a padding slot (in the inputs and in the output lists)."""

PAD_SCORE = 0.0
"""Score at padding slots of the output. 0 rather than −inf so that ``score * mask`` features
stay finite; always mask with ``doc_idx >= 0`` (:attr:`CoalitionLists.valid`), never by score."""

MAX_CHUNK_ELEMENTS = 2**22
"""Rollouts are processed in chunks of at most this many (coalition × candidate) elements
(about 4M): the work tensors (float32/float64 scores, int64 sort indices) peak near 100 MB."""


@dataclass(frozen=True)
class CoalitionLists:
    """Merged result lists of every coalition of every rollout.

    Attributes:
        doc_idx: ``(R, 2**M, K)`` int64 row ids into the index, ``PAD_DOC`` (−1) at padding.
            Coalition 0 (∅) is all padding; coalition ``2**M − 1`` merges all actions.
        scores: ``(R, 2**M, K)`` float32, descending along K; ``PAD_SCORE`` (0) at padding.
        n_actions: ``(R,)`` int64, real actions per rollout; the others are null players.
    """

    doc_idx: torch.Tensor
    scores: torch.Tensor
    n_actions: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        """``(R, 2**M, K)`` bool, True at real (non-padding) list slots."""
        return self.doc_idx >= 0

    @property
    def n_coalitions(self) -> int:
        """``2**M``."""
        return int(self.doc_idx.shape[1])


def _check_inputs(doc_idx: torch.Tensor, scores: torch.Tensor, n_actions: torch.Tensor) -> None:
    if doc_idx.ndim != 3 or scores.shape != doc_idx.shape:
        msg = (
            f"doc_idx and scores must both be (R, M, k); got {tuple(doc_idx.shape)} "
            f"and {tuple(scores.shape)}"
        )
        raise ValueError(msg)
    n_rollouts, n_slots, _ = doc_idx.shape
    if not 1 <= n_slots <= MAX_PLAYERS:  # coalitions are enumerated exhaustively (exact Shapley)
        msg = f"M (actions per rollout) must be in [1, {MAX_PLAYERS}], got {n_slots}"
        raise ValueError(msg)
    if n_actions.shape != (n_rollouts,):
        msg = f"n_actions must be ({n_rollouts},), got {tuple(n_actions.shape)}"
        raise ValueError(msg)
    if doc_idx.dtype != torch.int64 or n_actions.dtype != torch.int64:
        msg = f"doc_idx and n_actions must be int64, got {doc_idx.dtype} and {n_actions.dtype}"
        raise ValueError(msg)
    acting = torch.arange(n_slots, device=doc_idx.device)[None, :] < n_actions[:, None]
    if not torch.isfinite(scores[(doc_idx >= 0) & acting[:, :, None]]).all():
        msg = "scores of real entries (doc_idx >= 0 of actions j < n_actions) must be finite"
        raise ValueError(msg)


def _local_vocabulary(docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row compact vocabulary of document ids, without a Python loop over rows.

    Args:
        docs: ``(R, C)`` int64 document ids (padding must already be a sentinel id).

    Returns:
        ``slot`` ``(R, C)``: each entry's vocabulary id; equal documents share one, and ids
        increase with the document id. ``vocab`` ``(R, C)``: the document id of each slot
        (slots past a row's vocabulary size hold the row's largest id; they are never used).
    """
    sorted_docs, order = torch.sort(docs, dim=1, stable=True)  # (R, C)
    is_new = torch.ones_like(sorted_docs, dtype=torch.bool)
    is_new[:, 1:] = sorted_docs[:, 1:] != sorted_docs[:, :-1]
    sorted_slot = is_new.long().cumsum(dim=1) - 1  # (R, C): rank among distinct ids
    slot = torch.empty_like(sorted_slot).scatter_(1, order, sorted_slot)
    vocab = sorted_docs.clone()  # rows of equal ids write the same value: deterministic
    vocab.scatter_(1, sorted_slot, sorted_docs)
    return slot, vocab


def _action_scores(
    scores: torch.Tensor, real: torch.Tensor, merge: str, rrf_k: float
) -> tuple[torch.Tensor, float]:
    """(R, M, k) score of every entry under ``merge`` and the fill value of absent documents:
    ``max``: the retrieval score, absent −inf (float32); ``rrf`` and ``pool``: 1/(rrf_k + rank),
    absent 0 (float64), rank = 1-based position among the list's real entries."""
    if merge == "max":
        return torch.where(real, scores.to(torch.float32), -torch.inf), -float("inf")
    rank = real.long().cumsum(-1).to(torch.float64)  # (R, M, k): 1-based at real entries
    return torch.where(real, 1.0 / (rrf_k + rank), 0.0), 0.0


def _merge_chunk(
    doc_idx: torch.Tensor,
    scores: torch.Tensor,
    n_actions: torch.Tensor,
    top_k: int,
    anchored: bool = False,
    merge: str = "max",
    rrf_k: float = DEFAULT_RRF_K,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`coalition_lists` on one chunk of rollouts; returns ``(doc_idx, scores)``.

    ``anchored``: slot M − 1 of the inputs is the anchor list, in every coalition (∅ included);
    the output then has 2^(M−1) coalitions of the M − 1 players.
    """
    n_rollouts, n_slots, k = doc_idx.shape
    n_players = n_slots - int(anchored)
    device = doc_idx.device
    acting = torch.arange(n_slots, device=device)[None, :] < n_actions[:, None]  # (R, M)
    if anchored:
        acting[:, n_players] = True
    real = (doc_idx >= 0) & acting[:, :, None]  # (R, M, k)
    sentinel = torch.iinfo(torch.int64).max  # sorts after every real id
    docs = torch.where(real, doc_idx, sentinel).reshape(n_rollouts, n_slots * k)  # (R, C)
    slot, vocab = _local_vocabulary(docs)  # (R, C), (R, V) with V = C
    n_vocab = slot.shape[1]

    # each action's score on each vocabulary slot; `fill` where the action lacks the doc
    entry_scores, fill = _action_scores(scores, real, merge, rrf_k)
    dtype = entry_scores.dtype
    owner = torch.arange(n_slots, device=device).repeat_interleave(k) * n_vocab  # (C,)
    per_action = torch.full((n_rollouts, n_slots * n_vocab), fill, dtype=dtype, device=device)
    per_action.scatter_reduce_(1, slot + owner, entry_scores.reshape(slot.shape), reduce="amax")
    per_action = per_action.reshape(n_rollouts, n_slots, n_vocab)  # (R, M, V)

    # subset doubling into (R, 2^M, V): coalitions with bit j = those without it, plus action j
    combine = torch.maximum if merge == "max" else torch.add
    merged = torch.empty(n_rollouts, 2**n_players, n_vocab, dtype=dtype, device=device)
    merged[:, 0] = per_action[:, n_players] if anchored else fill  # ∅: the anchor or nothing
    for j in range(
        n_players
    ):  # M ≤ MAX_PLAYERS steps; step j fills the 2**j coalitions whose top bit is j
        low, high = merged[:, : 2**j], merged[:, 2**j : 2 ** (j + 1)]
        combine(low, per_action[:, j : j + 1], out=high)

    # stable sort: equal scores keep slot order, i.e. the smaller document id first
    ranked, ranked_slot = torch.sort(merged, dim=2, descending=True, stable=True)
    ranked, ranked_slot = ranked[:, :, :top_k], ranked_slot[:, :, :top_k]  # (R, 2^M, K')
    ranked_doc = vocab.gather(1, ranked_slot.reshape(n_rollouts, -1)).reshape(ranked.shape)
    present = ranked > fill
    out_doc = torch.where(present, ranked_doc, PAD_DOC)
    out_score = torch.where(present, ranked, PAD_SCORE).to(torch.float32)
    pad = top_k - out_doc.shape[2]  # K larger than the number of candidates
    if pad > 0:
        out_doc = torch.nn.functional.pad(out_doc, (0, pad), value=PAD_DOC)
        out_score = torch.nn.functional.pad(out_score, (0, pad), value=PAD_SCORE)
    return out_doc, out_score


def coalition_lists(
    doc_idx: torch.Tensor,
    scores: torch.Tensor,
    n_actions: torch.Tensor,
    top_k: int,
    *,
    chunk_size: int | None = None,
    anchor_idx: torch.Tensor | None = None,
    anchor_scores: torch.Tensor | None = None,
    merge: str = "max",
    rrf_k: float = DEFAULT_RRF_K,
) -> CoalitionLists:
    """Merged top-K list of every coalition of actions, for a batch of rollouts.

    Args:
        doc_idx: ``(R, M, k)`` int64 cached top-k row ids per action, ``−1`` = padding.
        scores: ``(R, M, k)`` float retrieval scores, finite at real entries (anything, e.g.
            FAISS's −inf/±3.4e38, at padding).
        n_actions: ``(R,)`` int64; actions ``j ≥ n_actions[r]`` are padding (null players).
        top_k: ``K``, length of every merged list.
        chunk_size: rollouts per chunk; default keeps each chunk under ``MAX_CHUNK_ELEMENTS``.
        anchor_idx, anchor_scores: ``(R, k)`` the anchor list of each rollout (the user query's
            own results), merged into EVERY coalition, ∅ included; None = no anchor.
        merge: ``"max"`` (best score), ``"rrf"`` (Σ 1/(rrf_k + rank)) or ``"pool"`` (the union,
            ranked as ``rrf``, never cut: ``top_k`` is then ignored); see the module docstring.
        rrf_k: the ``rrf`` constant, ≥ 0 (default 60).

    Returns:
        :class:`CoalitionLists` with ``(R, 2**M, K)`` lists on the inputs' device. Each
        document scores its merged score over the coalition's lists (under ``rrf`` the output
        scores are the fused scores); ties rank the smaller document id first.
    """
    _check_inputs(doc_idx, scores, n_actions)
    check_merge(merge)
    if top_k < 1:
        msg = f"top_k must be >= 1, got {top_k}"
        raise ValueError(msg)
    if rrf_k < 0:
        msg = f"rrf_k must be >= 0, got {rrf_k}"
        raise ValueError(msg)
    anchored = anchor_idx is not None
    if anchor_idx is not None:
        if anchor_scores is None or anchor_idx.shape != (doc_idx.shape[0], doc_idx.shape[2]):
            msg = f"anchor_idx and anchor_scores must both be (R, k) = {(doc_idx.shape[0], doc_idx.shape[2])}"
            raise ValueError(msg)
        doc_idx = torch.cat([doc_idx, anchor_idx[:, None]], 1)  # the anchor is slot M
        scores = torch.cat([scores.to(torch.float32), anchor_scores[:, None].to(torch.float32)], 1)
    n_rollouts, n_slots, k = doc_idx.shape
    n_players = n_slots - int(anchored)
    if merge == "pool":  # the pool holds every candidate: as wide as all lists together
        top_k = n_slots * k
    if chunk_size is None:
        chunk_size = max(1, MAX_CHUNK_ELEMENTS // (2**n_players * n_slots * k))
    if chunk_size < 1:
        msg = f"chunk_size must be >= 1, got {chunk_size}"
        raise ValueError(msg)
    docs_out: list[torch.Tensor] = []
    scores_out: list[torch.Tensor] = []
    for start in range(0, n_rollouts, chunk_size):
        part = slice(start, start + chunk_size)
        d, s = _merge_chunk(
            doc_idx[part], scores[part], n_actions[part], top_k, anchored, merge, float(rrf_k)
        )
        docs_out.append(d)
        scores_out.append(s)
    if not docs_out:  # R = 0
        empty = doc_idx.new_empty(0, 2**n_players, top_k)
        return CoalitionLists(empty, scores.new_empty(empty.shape, dtype=torch.float32), n_actions)
    return CoalitionLists(torch.cat(docs_out), torch.cat(scores_out), n_actions)
