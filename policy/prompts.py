"""Prompts: what a rewrite policy is asked, in each prompt style.

Read :data:`PROMPT_STYLES`, then :func:`build_prompt_text`. ``oneshot`` and ``short`` ask for m
numbered rewrites of a claim (with or without one worked example turn); ``feedback`` shows the
query and its feedback context — the words keyword expansion reads in the query's first
retrieval, built by `evaluator.feedback.FeedbackContext` and passed in by every caller (training,
the held-out evaluation, the warm start, serving, the audit, the adapters), never built here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "DEFAULT_FEEDBACK_WORDS", "PROMPT_STYLES", "ContextSource", "build_prompt",
    "build_prompt_text", "check_contexts",
]  # fmt: skip

SYSTEM_PROMPT = "You rewrite scientific claims into short search queries."
USER_TEMPLATE = (
    "Write {n} different search queries that would retrieve scientific abstracts supporting or "
    "refuting the claim below. Answer with exactly {n} numbered lines (1. ... to {n}. ...) and "
    "nothing else.\n\nClaim: {query}"
)
# One worked example turn before the real claim. Measured on SmolLM2-135M-Instruct (4 SciFact
# claims x 4 samples, T = 0.7): 69 % of outputs have exactly m numbered on-topic lines with it,
# versus mostly unnumbered restatements of the claim without it (see README).
EXAMPLE_CLAIM = "Aspirin use reduces the risk of colorectal cancer."
EXAMPLE_REWRITES = (
    "aspirin colorectal cancer risk",
    "NSAID chemoprevention colon tumors",
    "cyclooxygenase inhibition colorectal adenoma",
    "aspirin cancer incidence cohort study",
    "low-dose aspirin randomized trial cancer",
    "COX-2 colorectal carcinogenesis",
    "aspirin polyp recurrence",
    "anti-inflammatory drugs bowel cancer prevention",
    "aspirin mortality colorectal cancer",
    "platelet inhibition tumor growth",
    "aspirin dose duration cancer protection",
    "colorectal cancer prevention meta-analysis",
)


PROMPT_STYLES = ("oneshot", "short", "feedback")
"""oneshot: system + one worked example turn + the claim (the untrained policy needs the example
to answer in the format); short: system + the claim only (about a third of the tokens; for a
policy that learned the format, e.g. after `casi policy warmstart --prompt short`); feedback:
system + the query + what its first retrieval found, the ranked words keyword expansion reads
(`evaluator.feedback`; every call passes the context; for a policy warm-started on it,
`casi policy warmstart --source prf --prompt feedback`)."""

FEEDBACK_SYSTEM_PROMPT = "You rewrite search queries into short keyword queries."
FEEDBACK_TEMPLATE = (
    "Write {n} different search queries that find more documents for the query below. Its "
    "first search found documents whose most telling words follow, best first. Answer with "
    "exactly {n} numbered lines (1. ... to {n}. ...) and nothing else.\n\nQuery: {query}\n"
    "Words: {context}"
)
DEFAULT_FEEDBACK_WORDS = 30
"""Feedback words a ``feedback`` prompt shows (`RolloutConfig.feedback_words`): at least the
m · 6 words keyword expansion deals at m = 4, so its rewrites are a function of the context."""


ContextSource = Callable[[Sequence[str], int, int], list[str]]
"""(queries, n_words, n_actions) → each query's feedback context (`evaluator.feedback.FeedbackContext.contexts`,
passed in by the app: the policy never builds a retriever)."""


def check_contexts(style: str, contexts: Sequence[str | None] | None, n: int) -> None:
    """A ``feedback`` prompt needs one context per query, and only it takes them."""
    if style == "feedback":
        if contexts is None or len(contexts) != n or any(c is None for c in contexts):
            got = "none" if contexts is None else f"{len(contexts)} (some missing)"
            raise ValueError(
                f"prompt style 'feedback' needs one feedback context per query ({n}); got {got} "
                "(evaluator.feedback.FeedbackContext.contexts builds them)"
            )
    elif contexts is not None and any(c is not None for c in contexts):
        raise ValueError(f"prompt style {style!r} takes no feedback context")


def build_prompt_text(
    tokenizer: Any, query: str, n_actions: int, style: str = "oneshot", context: str | None = None
) -> str:
    """Chat-formatted prompt asking for ``n_actions`` numbered rewrites (generation prompt on).

    ``context``: the query's feedback words (`evaluator.feedback`), required by style
    ``feedback`` and refused by the others."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {style!r}; valid: {list(PROMPT_STYLES)}")
    check_contexts(style, [context], 1)
    if style == "feedback":
        assert context is not None
        user = FEEDBACK_TEMPLATE.format(
            n=n_actions, query=" ".join(query.split()), context=" ".join(context.split())
        )
        return _render(tokenizer, FEEDBACK_SYSTEM_PROMPT, [], user)
    user = USER_TEMPLATE.format(n=n_actions, query=" ".join(query.split()))
    shot = "\n".join(f"{i}. {t}" for i, t in enumerate(EXAMPLE_REWRITES[:n_actions], start=1))
    example = [
        {"role": "user", "content": USER_TEMPLATE.format(n=n_actions, query=EXAMPLE_CLAIM)},
        {"role": "assistant", "content": shot},
    ]
    return _render(tokenizer, SYSTEM_PROMPT, example if style == "oneshot" else [], user)


def _render(tokenizer: Any, system: str, turns: list[dict[str, str]], user: str) -> str:
    """The chat template over system + ``turns`` + the user turn (generation prompt on); a
    tokenizer without a template gets plain text (no worked example)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": system},
            *turns,
            {"role": "user", "content": user},
        ]
        return str(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        )
    return f"{system}\n\n{user}\n\nAnswer:\n"


def build_prompt(
    tokenizer: Any, query: str, n_actions: int, style: str = "oneshot", context: str | None = None
) -> list[int]:
    """Token ids of `build_prompt_text` (no extra special tokens: the template has them)."""
    text = build_prompt_text(tokenizer, query, n_actions, style, context)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
