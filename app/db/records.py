"""THE stored form of one credited rollout: a :class:`~evaluator.credit.CreditResult` row → the
``credit_records`` dict `repositories.add_credit_records` takes. The API (`POST /v1/credits`)
and training (`casi step`, `casi train`) both store through :func:`credit_record`, so a record
looks the same whoever wrote it.

A record names its game by its merge rule (``merge``: max | rrf = the list game, pool = the
pooled game, :func:`game_of`); in the pooled game it also keeps who found what, as counts
(:func:`pool_summary`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from evaluator.credit import CreditResult
from evaluator.games import GAMES, pool_counts

CACHE_STATS = ("status", "hits", "misses", "unique", "embedded")
"""What a record keeps of the credit call's cache report (this batch only, not the totals)."""
RETRIEVED_ROWS = ("action_rows", "anchor_rows")
"""Keys of `CreditResult.record` a stored record leaves out: the retrieved rows (the action
cache holds them; the dashboard rebuilds the lists from it)."""


def cache_stats(cache: Mapping[str, Any]) -> dict[str, Any]:
    return {k: cache[k] for k in CACHE_STATS if k in cache}


def game_of(merge: str | None) -> str | None:
    """The game whose coalition lists are built by ``merge`` (pool → pool; max, rrf → list);
    None for a record stored before its merge rule was recorded."""
    if merge is None:
        return None
    return next((name for name, g in GAMES.items() if g.merge == merge), "list")


def pool_summary(result: CreditResult, i: int) -> dict[str, Any]:
    """Who found what in rollout ``i``'s pool, as counts (:func:`pool_summary_of`)."""
    m = int(result.n_actions[i])
    anchor = None if result.anchor_rows is None else result.anchor_rows[i]
    return pool_summary_of(result.action_rows[i, :m], anchor)


def pool_summary_of(rows: torch.Tensor, anchor: torch.Tensor | None) -> dict[str, Any]:
    """``rows`` (m, k) each rewrite's list, ``anchor`` (k,) the query's own list or None (−1
    padding) → ``anchor`` (documents in the query's own list; 0 with the anchor off), ``size``
    (the pool of the query and every rewrite), per rewrite ``new`` (documents of its list the
    query's lacks) and ``only`` (of those, the ones no other rewrite found: the coverage game
    pays them to it alone; copies of one rewrite have none)."""
    m = rows.shape[0]
    counts = pool_counts(rows[None], torch.tensor([m]), None if anchor is None else anchor[None])
    own = set() if anchor is None else set(anchor.tolist()) - {-1}
    return {
        "anchor": len(own),
        "size": len((set(rows.flatten().tolist()) - {-1}) | own),
        "new": counts.new[0].sum(-1).tolist(),
        "only": (counts.new & (counts.n_found == 1))[0].sum(-1).tolist(),
    }


def found_by(lists: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """Each document row of ``lists`` (one list of rows per rewrite, −1 padding) → the indices
    of the rewrites whose list holds it, ascending."""
    out: dict[int, list[int]] = {}
    for j, own in enumerate(lists):
        for row in set(own) - {-1}:
            out.setdefault(row, []).append(j)
    return out


def credit_record(
    result: CreditResult,
    i: int,
    *,
    run_id: int | None,
    step: int | None,
    sample_index: int,
    policy_version: str,
    format_status: str,
    advantages: dict[str, Any],
) -> dict[str, Any]:
    """Rollout ``i`` of ``result`` as a ``credit_records`` row (its retrieved rows are not kept)."""
    record = {k: v for k, v in result.record(i).items() if k not in RETRIEVED_ROWS}
    return {
        **record,
        "pool": pool_summary(result, i) if game_of(result.merge) == "pool" else None,
        "run_id": run_id,
        "step": step,
        "sample_index": sample_index,
        "policy_version": policy_version,
        "format_status": format_status,
        "advantages": advantages,
        "cache_stats": cache_stats(result.cache),
    }
