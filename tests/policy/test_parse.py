"""Parser: exact token spans (property test on the real tokenizer) and status edge cases."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.parse import normalize_action_text, parse_actions

WORDS = [
    "cancer",
    "Vitamin",
    "D",
    "über",
    "straße",
    "中文",
    "naïve",
    "ß",
    "🙂",
    "α-synuclein",
    "COVID-19",
    "p53",
    "x",
    "résumé",
    "Ünïcödé",
    "日本語",
    "ok",
    "(CI",
    "95%)",
    "mg/kg",
]


def _encode(tok: Any, text: str, eos: bool = True) -> list[int]:
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    return ids + [tok.eos_token_id] if eos else ids


def _decode_span(tok: Any, ids: list[int], start: int, end: int) -> str:
    return normalize_action_text(tok.decode(ids[start:end], clean_up_tokenization_spaces=False))


def _assert_spans_exact(tok: Any, ids: list[int], parsed: Any) -> None:
    previous_end = 0
    for action in parsed.actions:
        assert previous_end <= action.token_start < action.token_end <= len(ids)
        assert _decode_span(tok, ids, action.token_start, action.token_end) == action.text
        assert not any(parsed.shared_token_mask[action.token_start : action.token_end])
        previous_end = action.token_end


line_content = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
markers = st.sampled_from(["{i}. ", "{i}) ", "{i}.  ", "  {i}. ", "- ", "{i}: "])


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lines=st.lists(st.tuples(markers, line_content, st.integers(0, 2)), min_size=0, max_size=7),
    preamble=st.sampled_from(["", "Here are the queries:\n", "Sure!\n\n"]),
    n_expected=st.integers(1, 5),
)
def test_spans_decode_exactly_to_action_text(
    smol_tokenizer: Any, lines: list, preamble: str, n_expected: int
) -> None:
    text = preamble + "".join(
        m.format(i=i) + content + "\n" * (1 + blanks)
        for i, (m, content, blanks) in enumerate(lines, start=1)
    )
    ids = _encode(smol_tokenizer, text)
    parsed = parse_actions(ids, smol_tokenizer, n_expected)
    _assert_spans_exact(smol_tokenizer, ids, parsed)
    # The SmolLM2 pre-tokenizer never merges the marker with the content: full content kept.
    assert [a.text for a in parsed.actions] == [content for _, content, _ in lines][:n_expected]
    assert parsed.n_found == len(lines)
    assert parsed.status == (
        "empty"
        if not lines
        else "too_few"
        if len(lines) < n_expected
        else "too_many"
        if len(lines) > n_expected
        else "ok"
    )
    assert parsed.shared_token_mask[-1]  # EOS is shared


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(0, 49151), max_size=40), n_expected=st.integers(0, 6))
def test_never_raises_on_random_tokens(
    smol_tokenizer: Any, ids: list[int], n_expected: int
) -> None:
    parsed = parse_actions(ids, smol_tokenizer, n_expected)
    assert len(parsed.shared_token_mask) == len(ids)
    assert len(parsed.actions) <= max(n_expected, 0)
    _assert_spans_exact(smol_tokenizer, ids, parsed)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60).map(
        lambda s: "1. " + s.replace("\r", "") + "\n2. " + s[::-1]
    )
)
def test_spans_exact_for_arbitrary_unicode(smol_tokenizer: Any, text: str) -> None:
    ids = _encode(smol_tokenizer, text)
    _assert_spans_exact(smol_tokenizer, ids, parse_actions(ids, smol_tokenizer, 3))


@pytest.mark.parametrize(
    ("text", "n", "eos", "status", "texts"),
    [
        ("1. a b\n2. c\n3. d", 3, True, "ok", ["a b", "c", "d"]),
        ("1. a\n2. b", 4, True, "too_few", ["a", "b"]),
        ("1. a\n2. b\n3. c\n4. d", 2, True, "too_many", ["a", "b"]),
        ("1. a\n\n\n2. b\n  \n3. c\n", 3, True, "ok", ["a", "b", "c"]),
        ("1. a\n2. \n3. c", 2, True, "ok", ["a", "c"]),
        (
            "1. vitamin d\n2. Vitamin  D\n3. other",
            3,
            True,
            "ok",
            ["vitamin d", "Vitamin  D", "other"],
        ),
        ("1. a\n2. b\n3. incomplete que", 3, False, "truncated", ["a", "b", "incomplete que"]),
        ("1. 中文 検索\n2. naïve straße 🙂", 2, True, "ok", ["中文 検索", "naïve straße 🙂"]),
        ("I cannot help with that.", 4, True, "empty", []),
        ("", 4, True, "empty", []),
        ("!!!\n???\n1.5 mg of aspirin\n", 2, True, "empty", []),
        ("Sure, here you go:\n1) first\n2) second", 2, True, "ok", ["first", "second"]),
        ("1. a\n2. b", 2, False, "truncated", ["a", "b"]),
    ],
)
def test_status_edge_cases(
    smol_tokenizer: Any, text: str, n: int, eos: bool, status: str, texts: list[str]
) -> None:
    ids = _encode(smol_tokenizer, text, eos=eos)
    parsed = parse_actions(ids, smol_tokenizer, n)
    assert parsed.status == status
    assert [a.text for a in parsed.actions] == texts
    _assert_spans_exact(smol_tokenizer, ids, parsed)


def test_duplicates_are_kept_and_flagged(smol_tokenizer: Any) -> None:
    ids = _encode(smol_tokenizer, "1. vitamin d\n2. other\n3. Vitamin  D\n4. vitamin d")
    parsed = parse_actions(ids, smol_tokenizer, 4)
    assert parsed.status == "ok" and parsed.has_duplicates
    assert [a.duplicate_of for a in parsed.actions] == [None, None, 0, 0]


def test_too_many_later_lines_become_shared(smol_tokenizer: Any) -> None:
    ids = _encode(smol_tokenizer, "1. a\n2. b\n3. c")
    parsed = parse_actions(ids, smol_tokenizer, 2)
    assert parsed.n_found == 3 and len(parsed.actions) == 2
    third = parsed.actions[1].token_end
    assert all(parsed.shared_token_mask[third:])


def test_marker_needs_whitespace_and_punctuation_content_is_kept(smol_tokenizer: Any) -> None:
    """'1.. x' and '1.5 mg' are not numbered lines; '1. ...x' keeps its leading dots."""
    ids = _encode(smol_tokenizer, "1.. x\n1.5 mg\n1. ...x\n2. (CI 95%)")
    parsed = parse_actions(ids, smol_tokenizer, 2)
    assert [a.text for a in parsed.actions] == ["...x", "(CI 95%)"]
    _assert_spans_exact(smol_tokenizer, ids, parsed)


def test_tokens_after_stop_are_shared_and_ignored(smol_tokenizer: Any) -> None:
    ids = _encode(smol_tokenizer, "1. a") + _encode(smol_tokenizer, "2. b", eos=False)
    parsed = parse_actions(ids, smol_tokenizer, 2)
    assert parsed.status == "too_few" and [a.text for a in parsed.actions] == ["a"]
