"""Input limits enforced at the edge (CLI options, and the API through the same checks).

Each limit is a named constant with its reason; :func:`check_text` / :func:`check_id` /
:func:`check_actions` raise :class:`app.errors.InputError` (one line, exit 2) instead of letting
an oversized input run for minutes and yield nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.errors import InputError
from evaluator.limits import MAX_PLAYERS  # exact Shapley enumerates 2^m coalitions

# The embedder reads at most 256 word pieces (≈ 1,000 characters of English) and the policy's
# prompt must stay a few hundred tokens: longer text is either ignored or makes generation slow.
MAX_QUERY_CHARS = 2000
MAX_REWRITE_CHARS = 1000
# Dataset ids (SciFact: ≤ 10 digits); longer input is a mistake, not an id.
MAX_ID_CHARS = 128
# Record ids (runs, audits, keys, jobs) are int4 columns on PostgreSQL: a larger number is no id
# (SQLite refused one as an OverflowError); the API's DB_INT_MAX.
MAX_RECORD_ID = 2**31 - 1


def check_text(text: str, option: str, limit: int = MAX_QUERY_CHARS) -> str:
    """``text`` stripped; empty or longer than ``limit`` characters → InputError."""
    stripped = text.strip()
    if not stripped:
        raise InputError(f"{option} is empty", option, "give some text")
    if len(stripped) > limit:
        raise InputError(
            f"{option} has {len(stripped):,} characters, more than the limit of {limit:,}",
            option,
            f"shorten it to at most {limit:,} characters",
        )
    return stripped


def check_id(value: str, option: str) -> str:
    """A dataset id: non-empty, printable, at most MAX_ID_CHARS characters."""
    if not value.strip() or len(value) > MAX_ID_CHARS or not value.isprintable():
        raise InputError(
            f"{option} {value[:40]!r} is not a dataset id",
            option,
            f"give an id from the dataset's queries.jsonl (≤ {MAX_ID_CHARS} printable characters)",
        )
    return value.strip()


def check_actions(actions: Sequence[str], option: str = "--rewrites") -> list[str]:
    """1..MAX_PLAYERS rewrites, each within MAX_REWRITE_CHARS (empty rewrites are kept: a
    policy may emit one, and it retrieves nothing)."""
    if not actions or len(actions) > MAX_PLAYERS:
        raise InputError(
            f"{option} got {len(actions)} rewrites",
            option,
            f'give 1 to {MAX_PLAYERS} rewrites: --rewrites "a" "b" "c"',
        )
    for a in actions:
        if len(a) > MAX_REWRITE_CHARS:
            raise InputError(
                f"a rewrite has {len(a):,} characters, more than the limit of {MAX_REWRITE_CHARS:,}",
                option,
                "shorten it",
            )
    return list(actions)
