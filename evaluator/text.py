"""Content words of a text: the one stopword list and keyword extractor, shared by the warm
start's pseudo-rewrites (:mod:`policy.warmstart`) and the keyword-expansion baseline
(:mod:`evaluator.prf`). Read :func:`content_words`."""

from __future__ import annotations

import re

__all__ = ["MAX_KEYWORDS", "STOPWORDS", "content_words", "keywords"]

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
