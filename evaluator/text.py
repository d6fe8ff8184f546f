"""Content words of a text: the one stopword list and keyword extractor, shared by the warm
start's pseudo-rewrites (:mod:`policy.warmstart`) and the keyword-expansion baseline
(:mod:`evaluator.prf`). Read :func:`content_words`."""

from __future__ import annotations

import re

__all__ = ["MAX_KEYWORDS", "STOPWORDS", "content_words", "degenerate", "keywords"]

MAX_KEYWORDS = 8  # a keyword query longer than this is cut: search queries are short

STOPWORDS = frozenset(
    """a an the and or but if of to in on at by for with from into onto over under than then
    that this these those is are was were be been being has have had do does did not no nor
    as it its it's their there they them we our you your he she his her which who whom whose
    what when where why how can could may might must shall should will would also more most
    such only both each other some any all very between among during after before about
    against through via per versus vs""".split()
)
_WORD_RE = re.compile(r"[\w'-]+", re.UNICODE)


def content_words(text: str) -> list[str]:
    """Lowercased words of ``text`` in order, stopwords removed (duplicates kept)."""
    words = (w.strip("'-") for w in _WORD_RE.findall(text.lower()))
    return [w for w in words if w and w not in STOPWORDS]


def keywords(text: str, limit: int = MAX_KEYWORDS) -> str:
    """Lowercased content words of ``text`` in order, stopwords and duplicates removed, at most
    ``limit`` of them."""
    return " ".join(list(dict.fromkeys(content_words(text)))[:limit])


DIGIT_RUN = 6
"""A rewrite holding this many digits in a row is degenerate (:func:`degenerate`)."""
_REPEAT_RE = re.compile(r"\b(\w+)\b(?:\W+\1\b){2,}", re.UNICODE)
_DIGITS_RE = re.compile(rf"\d{{{DIGIT_RUN},}}")


def degenerate(text: str) -> bool:
    """Whether a rewrite is a string of repeats rather than a search query: a word three times
    in a row (``Response Response Response``, case-insensitive, any separator), a run of
    :data:`DIGIT_RUN` or more digits (``12345678911223232``), or four or more words of which
    fewer than half are distinct (``cancer risk cancer risk cancer``). Measured on held-out
    rewrites (``degenerate_rate``); the definition is docs/methods.md §1.10."""
    lowered = text.casefold()
    if _REPEAT_RE.search(lowered) or _DIGITS_RE.search(lowered):
        return True
    words = re.findall(r"\w+", lowered)
    return len(words) >= 4 and 2 * len(set(words)) < len(words)
