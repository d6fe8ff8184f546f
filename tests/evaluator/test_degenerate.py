"""Degenerate rewrites (evaluator.text.degenerate): strings of repeats, not search queries."""

from __future__ import annotations

import pytest

from evaluator.text import degenerate


@pytest.mark.parametrize(
    "text",
    [
        "Response Response Response-12345678911223232",  # seen in a trained demo policy
        "cancer Cancer CANCER",  # a word three times in a row, any case
        "risk, risk; risk",  # any separator
        "trial 123456",  # a run of six digits
        "cancer risk cancer risk cancer",  # four or more words, fewer than half distinct
    ],
)
def test_strings_of_repeats_are_degenerate(text: str) -> None:
    assert degenerate(text)


@pytest.mark.parametrize(
    "text",
    [
        "aspirin colorectal cancer risk",
        "p53 p53 mutation",  # twice in a row is a query
        "1990 2000 cohort 12345",  # five digits: a year range, a PubMed-style number
        "vitamin d vitamin e",  # half distinct is not fewer than half
        "",
    ],
)
def test_search_queries_are_not(text: str) -> None:
    assert not degenerate(text)
