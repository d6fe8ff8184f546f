"""Keyword expansion by pseudo-relevance feedback: the non-learned baseline of the pooled game.

Read :class:`KeywordExpansion`. For a query, take the documents its own list ranks first (the
top ``feedback`` of the anchor), score every content word of those documents by its count in
them times its inverse document frequency in the corpus, and deal the best words round-robin
into m rewrites of ``words`` words each: rewrite i gets the words ranked i, i + m, i + 2m, …
The rewrites share no word, so their lists overlap little, and none repeats the query. It needs
no model and no judgement: what cheap expansion buys with the same budget of m actions.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from evaluator.text import content_words

__all__ = ["FEEDBACK_DOCS", "KeywordExpansion", "PRF_WORDS", "deal", "dealt_order"]

FEEDBACK_DOCS = 3
"""Documents of the query's own list the keywords come from."""

PRF_WORDS = 6
"""Words per expansion rewrite (search queries are short)."""

_NOISE = frozenset({"num"})  # NFCorpus's digit placeholder


def _words(text: str) -> list[str]:
    return [w for w in content_words(text) if len(w) > 2 and w not in _NOISE and not w.isdigit()]


class KeywordExpansion:
    """m keyword rewrites per query from its top documents (see the module docstring).

    ``texts``: every document's text in index row order (the idf is computed over them once)."""

    def __init__(
        self, texts: Sequence[str], feedback: int = FEEDBACK_DOCS, words: int = PRF_WORDS
    ) -> None:
        if feedback < 1 or words < 1:
            raise ValueError(f"feedback and words must be >= 1, got {feedback}, {words}")
        self.feedback, self.words = feedback, words
        self._tokens = [_words(t) for t in texts]
        df = Counter(w for tokens in self._tokens for w in set(tokens))
        n = len(texts)
        self._idf = {w: math.log((n + 1) / (c + 0.5)) for w, c in df.items()}

    def ranked(self, top_rows: Sequence[int]) -> list[str]:
        """Every content word of the documents at index rows ``top_rows`` (the query's own list,
        best first; −1 padding is skipped; the first ``feedback`` count), best first: count in
        those documents × idf, ties by first use. The words :meth:`rewrites` deals, and the
        words the policy's feedback prompt shows (:mod:`evaluator.feedback`)."""
        rows = [r for r in top_rows if r >= 0][: self.feedback]
        counts = Counter(w for r in rows for w in self._tokens[r])
        first = {
            w: i for i, w in reversed(list(enumerate(w for r in rows for w in self._tokens[r])))
        }
        return sorted(counts, key=lambda w: (-counts[w] * self._idf.get(w, 0.0), first[w]))

    def rewrites(self, top_rows: Sequence[int], n_actions: int) -> list[str]:
        """``n_actions`` rewrites from the documents at index rows ``top_rows`` (the query's own
        list, best first; −1 padding is skipped); fewer when the documents have too few words."""
        return deal(self.ranked(top_rows), n_actions, self.words)


def deal(ranked: Sequence[str], n_actions: int, words: int = PRF_WORDS) -> list[str]:
    """Deal the best ``n_actions · words`` of ``ranked`` round-robin into ``n_actions`` lines:
    line i gets the words ranked i, i + m, i + 2m, … (empty lines dropped)."""
    lines = [" ".join(ranked[i : n_actions * words : n_actions]) for i in range(n_actions)]
    return [line for line in lines if line]


def dealt_order(ranked: Sequence[str], n_actions: int, words: int = PRF_WORDS) -> list[str]:
    """``ranked`` reordered as :func:`deal` hands it out: line 1's words, line 2's, …, then the
    words no line got, best first. A permutation: :func:`deal` of the ranking is this order cut
    into consecutive runs, one per line."""
    dealt = [w for i in range(n_actions) for w in ranked[i : n_actions * words : n_actions]]
    return dealt + list(ranked[n_actions * words :])
