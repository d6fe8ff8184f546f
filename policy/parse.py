"""Parse one generated response into retrieval actions with exact token spans.

Read `parse_actions` first. The policy answers with numbered lines ("1. query", "2) query",
bullets "- query" are accepted too); each such line is one *action* (one player of the
Shapley game). For every action we return its text and the half-open token span
``[token_start, token_end)`` in the generated ids, so the trainer can give the action's tokens
their own advantage; every other token (preamble, number prefixes, newlines, EOS) is *shared*.

Span rule (the contract the tests check):

* Character offsets come from decoding token prefixes (``decode(ids[:k])``). A boundary ``k``
  is usable only where the prefix decodes to a prefix of the full text; byte-level BPE tokens
  that split a UTF-8 character have no usable boundary inside them, so such tokens are grouped
  into *units* that always decode to whole characters.
* A unit belongs to the action of a line iff its first non-whitespace character lies inside the
  line's content (the part after the number prefix, whitespace-stripped). The span runs from the
  first to the last such unit (whitespace-only units in between are included).
* A unit straddling the prefix/content boundary (one that starts in the number prefix) is
  shared, so the action would lose those leading characters; a unit straddling the end of the
  content belongs to the action (trailing whitespace is stripped). With the SmolLM2 (GPT-2
  style) pre-tokenizer neither happens: the marker must be followed by whitespace, and
  punctuation never merges across whitespace or newlines, so ``text`` is the full content.
* Therefore, by construction: ``action.text == normalize_action_text(decode(ids[s:e]))``,
  where ``normalize_action_text`` only strips whitespace.

Statuses, by precedence: ``empty`` (no action found), ``truncated`` (no stop token: the model
hit ``max_new_tokens``; actions found so far are kept, the last one may be cut), ``too_few``,
``too_many`` (only the first ``n_expected`` actions are kept, the trainer pads to a fixed m;
later lines become shared tokens; ``n_found`` keeps the raw count), ``ok``. Duplicates
(case-insensitive, whitespace-collapsed) stay separate players and are flagged with
``duplicate_of``. The parser never raises on model output.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

STATUS_OK = "ok"
STATUS_TOO_FEW = "too_few"
STATUS_TOO_MANY = "too_many"
STATUS_TRUNCATED = "truncated"
STATUS_EMPTY = "empty"
STATUSES = (STATUS_OK, STATUS_TOO_FEW, STATUS_TOO_MANY, STATUS_TRUNCATED, STATUS_EMPTY)

# "1. x", "12) x", "3: x", "- x", "* x", "• x"; the marker must be followed by whitespace so that
# "1.5 mg of aspirin" is not read as item 1. Group "content" is the action (may be empty).
_LINE_RE = re.compile(
    r"^[ \t]*(?:(?:\d{1,3}[ \t]*[.):])|[-*•])[ \t]+(?P<content>.*?)[ \t\r]*$", re.UNICODE
)


@dataclass(frozen=True)
class Action:
    """One retrieval action: its text and its token span [token_start, token_end)."""

    text: str
    token_start: int
    token_end: int
    duplicate_of: int | None = None  # index of the first action with the same normalized text


@dataclass(frozen=True)
class ParsedOutput:
    """Actions of one response (at most ``n_expected``), a status and the shared-token mask."""

    actions: list[Action]
    status: str
    shared_token_mask: list[bool]  # (T,) True where the token is in no kept action
    n_found: int  # actions found before capping at n_expected
    text: str  # decoded response up to the first stop token

    @property
    def has_duplicates(self) -> bool:
        return any(a.duplicate_of is not None for a in self.actions)


def normalize_action_text(decoded_span: str) -> str:
    """The action text of a decoded token span: surrounding whitespace removed."""
    return decoded_span.strip()


def _dedup_key(text: str) -> str:
    return " ".join(text.casefold().split())


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), clean_up_tokenization_spaces=False))


def _unit_boundaries(tokenizer: Any, ids: Sequence[int], full: str) -> list[tuple[int, int]]:
    """Token indices k (0..n) where decode(ids[:k]) is a prefix of ``full``, with its length."""
    prefixes = tokenizer.batch_decode(
        [list(ids[:k]) for k in range(1, len(ids))], clean_up_tokenization_spaces=False
    )
    bounds = [(0, 0)]
    for k, text in enumerate(prefixes, start=1):
        if full.startswith(text) and len(text) > bounds[-1][1]:
            bounds.append((k, len(text)))
    bounds.append((len(ids), len(full)))
    return bounds


def _content_ranges(text: str) -> list[tuple[int, int]]:
    """(start, end) character ranges of non-empty numbered/bulleted line contents."""
    ranges = []
    pos = 0
    for line in text.split("\n"):
        match = _LINE_RE.match(line)
        if match and match.group("content").strip():
            start = pos + match.start("content")
            ranges.append((start, start + len(match.group("content"))))
        pos += len(line) + 1
    return ranges


def _first_non_space(text: str, start: int, end: int) -> int | None:
    for i in range(start, end):
        if not text[i].isspace():
            return i
    return None


def _spans(
    text: str, bounds: list[tuple[int, int]], ranges: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Token span of each content range under the first-non-whitespace-character rule."""
    owner: list[tuple[int, int, int]] = []  # (token_start, token_end, range index) per unit
    r = 0
    for (k0, c0), (k1, c1) in zip(bounds, bounds[1:], strict=False):
        first = _first_non_space(text, c0, c1)
        if first is None:
            continue
        while r < len(ranges) and ranges[r][1] <= first:
            r += 1
        if r < len(ranges) and ranges[r][0] <= first:
            owner.append((k0, k1, r))
    spans: dict[int, tuple[int, int]] = {}
    for k0, k1, idx in owner:
        start = spans[idx][0] if idx in spans else k0
        spans[idx] = (start, k1)
    return [spans[i] for i in sorted(spans)]


def _status(n_found: int, n_expected: int, truncated: bool) -> str:
    if n_found == 0:
        return STATUS_EMPTY
    if truncated:
        return STATUS_TRUNCATED
    if n_found < n_expected:
        return STATUS_TOO_FEW
    if n_found > n_expected:
        return STATUS_TOO_MANY
    return STATUS_OK


def parse_actions(
    token_ids: Sequence[int],
    tokenizer: Any,
    n_expected: int,
    stop_token_ids: Iterable[int] | None = None,
) -> ParsedOutput:
    """Split generated ``token_ids`` (T,) into at most ``n_expected`` actions with token spans.

    Tokens from the first stop token on (default: the tokenizer's special tokens) are shared and
    not decoded; a response without a stop token is ``truncated``. Never raises on model output.
    """
    ids = [int(t) for t in token_ids]
    stops = set(tokenizer.all_special_ids if stop_token_ids is None else stop_token_ids)
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    truncated = end == len(ids)
    body = ids[:end]
    text = _decode(tokenizer, body) if body else ""
    spans = _spans(text, _unit_boundaries(tokenizer, body, text), _content_ranges(text))
    actions: list[Action] = []
    first_seen: dict[str, int] = {}
    for start, stop in spans[: max(n_expected, 0)]:
        action_text = normalize_action_text(_decode(tokenizer, body[start:stop]))
        key = _dedup_key(action_text)
        actions.append(Action(action_text, start, stop, first_seen.get(key)))
        first_seen.setdefault(key, len(actions) - 1)
    shared = [True] * len(ids)
    for action in actions:
        for t in range(action.token_start, action.token_end):
            shared[t] = False
    return ParsedOutput(
        actions=actions,
        status=_status(len(spans), n_expected, truncated),
        shared_token_mask=shared,
        n_found=len(spans),
        text=text,
    )
