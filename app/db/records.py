"""THE stored form of one credited rollout: a :class:`~evaluator.credit.CreditResult` row → the
``credit_records`` dict `repositories.add_credit_records` takes. The API (`POST /v1/credits`)
and training (`casi step`, `casi train`) both store through :func:`credit_record`, so a record
looks the same whoever wrote it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from evaluator.credit import CreditResult

CACHE_STATS = ("status", "hits", "misses", "unique", "embedded")
"""What a record keeps of the credit call's cache report (this batch only, not the totals)."""


def cache_stats(cache: Mapping[str, Any]) -> dict[str, Any]:
    return {k: cache[k] for k in CACHE_STATS if k in cache}


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
    record = {k: v for k, v in result.record(i).items() if k != "action_rows"}
    return {
        **record,
        "run_id": run_id,
        "step": step,
        "sample_index": sample_index,
        "policy_version": policy_version,
        "format_status": format_status,
        "advantages": advantages,
        "cache_stats": cache_stats(result.cache),
    }
