"""What the first retrieval found, as the policy reads it: the feedback context.

Read :class:`FeedbackContext`. Keyword expansion (:mod:`evaluator.prf`) reads the query's own
top documents and deals their best words into m rewrites; a policy prompted with the
``feedback`` style (`policy.prompts.PROMPT_STYLES`) reads the same words. For each query the
context is built from the query's own list (the anchor: the game's executor, through the action
cache, so a query the game has already run costs one Redis read): its top ``FEEDBACK_DOCS``
documents' content words ranked by count × idf (:meth:`evaluator.prf.KeywordExpansion.ranked`,
the very list keyword expansion deals its rewrites from), laid out in the order keyword
expansion deals them for m rewrites (:func:`evaluator.prf.dealt_order`: its first line's words,
its second line's, …, then the next-ranked words), cut to the first ``n_words``.

Why that order and not the ranking: the same words either way, but in dealt order keyword
expansion's rewrite i is a run of consecutive context words, so imitating it (the warm start's
teacher) is copying runs, which a small policy learns in a few hundred SFT steps, where dealing
a ranking round-robin (every m-th word) is a strided copy; training then moves the policy off
the teacher where credit says words or groupings pay.

This is THE context builder: serving (``POST /v1/rewrites``), training, the held-out
evaluation, the warm start's teacher and the TRL / verl adapters all call
:meth:`FeedbackContext.contexts`, so a policy reads the same context wherever it runs. With
``n_words`` ≥ m · ``PRF_WORDS`` the teacher's rewrites (:meth:`FeedbackContext.teacher`) are a
function of the context alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from evaluator.actions import ActionExecutor
from evaluator.limits import MAX_FEEDBACK_WORDS, MAX_PLAYERS
from evaluator.prf import KeywordExpansion, dealt_order

__all__ = ["FeedbackContext", "render_words"]


def render_words(words: Sequence[str]) -> str:
    """The context as the prompt shows it: the words separated by spaces."""
    return " ".join(words)


class FeedbackContext:
    """The feedback words of queries (see the module docstring).

    ``executor``: the game's executor (its retriever, depth and cache give the anchor list);
    ``expansion``: keyword expansion over the same index's documents."""

    def __init__(self, executor: ActionExecutor, expansion: KeywordExpansion) -> None:
        self.executor, self.expansion = executor, expansion

    @property
    def version(self) -> str:
        """What determines the words: the retriever's index and the expansion's settings."""
        key = f"{self.executor.retriever.version}|{self.expansion.feedback}|{self.expansion.words}"
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    def top_rows(self, queries: Sequence[str]) -> list[list[int]]:
        """Each query's own list (index rows, best first), in ONE cached batch."""
        if not queries:
            return []
        return [list(map(int, row)) for row in self.executor.run(list(queries)).rows]

    def words(self, queries: Sequence[str], n_words: int, n_actions: int) -> list[list[str]]:
        """The first ``n_words`` feedback words of each query in the order keyword expansion
        deals them for ``n_actions`` rewrites (fewer where its top documents have fewer)."""
        if not 1 <= n_words <= MAX_FEEDBACK_WORDS:
            raise ValueError(f"n_words must be in 1..{MAX_FEEDBACK_WORDS}, got {n_words}")
        if not 1 <= n_actions <= MAX_PLAYERS:
            raise ValueError(f"n_actions must be in 1..{MAX_PLAYERS}, got {n_actions}")
        deal_words = self.expansion.words
        return [
            dealt_order(self.expansion.ranked(rows), n_actions, deal_words)[:n_words]
            for rows in self.top_rows(queries)
        ]

    def contexts(self, queries: Sequence[str], n_words: int, n_actions: int) -> list[str]:
        """:meth:`words`, rendered as the prompt shows them (:func:`render_words`)."""
        return [render_words(w) for w in self.words(queries, n_words, n_actions)]

    def teacher(self, queries: Sequence[str], n_actions: int) -> list[list[str]]:
        """Keyword expansion's ``n_actions`` rewrites of each query: the warm start's answers."""
        return [self.expansion.rewrites(rows, n_actions) for rows in self.top_rows(queries)]
