"""Format warm start: supervised fine-tuning on pseudo-rewrites in the numbered-lines format.

Read `warmstart` first. The untrained SmolLM2 answers in the requested format only about half
the time; a short SFT on pseudo-rewrites teaches the format before RL. Pseudo-rewrites are
built from the query and the titles of its relevant documents (`make_warmstart_examples`,
source ``titles``): the query itself, its keywords (stopwords removed), each title, and title
keywords; or, for a game where rewrites must add documents, from the relevant documents alone
(``openings``: their opening content words; ``keywords``: their most frequent ones). The loss
is token-mean cross-entropy on the assistant answer only (prompt tokens are labelled -100).
Save the result with `policy.model.save_checkpoint`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from evaluator.text import content_words, keywords
from policy.params import top_params
from policy.prompts import build_prompt

IGNORE_INDEX = -100  # label value ignored by the loss (prompt and padding tokens)


@dataclass(frozen=True)
class WarmstartExample:
    """One SFT pair: the query (the prompt is built from it, with its feedback context when the
    prompt style is ``feedback``) and the numbered answer."""

    query: str
    n_actions: int
    answer: str  # "1. ...\n2. ...", exactly n_actions lines
    context: str | None = None  # the query's feedback words (`evaluator.feedback`), source prf


@dataclass
class WarmstartMetrics:
    """Loss curve and counts of one warm-start run."""

    losses: list[float] = field(default_factory=list)  # token-mean loss per optimizer step
    steps: int = 0
    tokens: int = 0  # supervised (answer) tokens seen
    truncated: int = 0  # examples cut at max_length (their answer lost its end of turn)


def _clean(text: str) -> str:
    return " ".join(text.split()).rstrip(".")


def pseudo_rewrites(
    query: str, titles: Sequence[str], n_actions: int, rng: random.Random
) -> list[str]:
    """``n_actions`` distinct (when possible) rewrites from the query and relevant titles."""
    titles = [_clean(t) for t in titles if t.strip()]
    primary = [_clean(query), keywords(query)]
    extra = titles + [keywords(t) for t in titles] + [keywords(query + " " + t) for t in titles]
    rng.shuffle(extra)
    candidates: list[str] = []
    for text in primary + extra:
        if text and text.casefold() not in {c.casefold() for c in candidates}:
            candidates.append(text)
    words = keywords(query, limit=64).split() or [_clean(query) or "query"]
    while len(candidates) < n_actions:  # too few sources: random keyword subsets
        size = max(1, min(len(words), rng.randint(2, 5)))
        candidates.append(" ".join(rng.sample(words, size)))
    head = candidates[:1] + rng.sample(candidates[1:], len(candidates) - 1)
    return head[:n_actions]


PSEUDO_SOURCES = ("titles", "openings", "keywords", "prf")
"""What pseudo-rewrites are made of (:func:`make_warmstart_examples`): ``titles`` (the query
first, its keywords, the titles of its relevant documents and their keywords: the list game's
recipe), ``openings`` (the opening content words of distinct relevant documents, never the
query: in an anchored game the query is in every coalition already) or ``keywords`` (each
relevant document's most frequent content words, never the query); ``prf`` is the teacher:
keyword expansion's own rewrites of the query, read from its feedback context
(:func:`teacher_examples`; needs no judgement, only the query's first retrieval)."""

DEFAULT_WORDS = 8
"""Words per document pseudo-rewrite (``openings`` / ``keywords``)."""

BOILERPLATE_SHARE = 0.5
"""A word in more than this share of a corpus's documents is boilerplate, never part of a
document pseudo-rewrite (NFCorpus: ``abstract``, ``num`` — its digit placeholder — ``pubmed``,
``ncbi``); where one opens a document, the words before it are the document's title."""


def boilerplate(texts: Sequence[str], share: float = BOILERPLATE_SHARE) -> frozenset[str]:
    """The content words of more than ``share`` of ``texts`` (see :data:`BOILERPLATE_SHARE`)."""
    df = Counter(w for text in texts for w in set(content_words(text)))
    return frozenset(w for w, c in df.items() if c > share * len(texts))


def _document_words(text: str, noise: frozenset[str]) -> tuple[list[str], list[str]]:
    """(title, body): the content words before the first boilerplate word and the others, both
    without boilerplate, numbers or repeats (a document without boilerplate is all title)."""
    words = [w for w in content_words(text) if not w.isdigit()]
    cut = next((i for i, w in enumerate(words) if w in noise), len(words))
    title = list(dict.fromkeys(words[:cut]))
    body = [w for w in dict.fromkeys(words[cut:]) if w not in noise and w not in title]
    return title, body


MIN_TITLE_WORDS = 3
"""A shorter title is not used alone: the opening line then runs on into the body."""


def document_line(
    text: str, source: str, words: int, offset: int = 0, noise: frozenset[str] = frozenset()
) -> str:
    """One pseudo-rewrite of a relevant document, starting at ``offset``: its opening content
    words (``openings``: the title when it has at least :data:`MIN_TITLE_WORDS`, cut to
    ``words``) or its most frequent ones (``keywords``, ties in order of first use)."""
    title, body = _document_words(text, noise)
    if source == "keywords":
        counts = Counter(w for w in content_words(text) if w not in noise)
        ordered = sorted(title + body, key=lambda w: -counts[w])  # stable: first-use ties
    elif offset == 0 and len(title) >= MIN_TITLE_WORDS:
        return " ".join(title[:words])
    else:
        ordered = title + body
    return " ".join(ordered[offset : offset + words])


def document_rewrites(
    texts: Sequence[str],
    n_actions: int,
    rng: random.Random,
    source: str,
    words: int,
    noise: frozenset[str] = frozenset(),
) -> list[str]:
    """``n_actions`` distinct lines from distinct relevant documents in random order; with fewer
    documents than lines, the next words of the same documents fill the rest."""
    order = rng.sample(list(texts), len(texts))
    lines: list[str] = []
    for offset in range(0, 64 * words, words):
        for text in order:
            line = document_line(text, source, words, offset, noise)
            if line and line not in lines:
                lines.append(line)
            if len(lines) == n_actions:
                return lines
    return lines


def make_warmstart_examples(
    items: Sequence[tuple[str, Sequence[str]]],
    n_actions: int,
    seed: int = 0,
    source: str = "titles",
    words: int = DEFAULT_WORDS,
    noise: frozenset[str] = frozenset(),
) -> list[WarmstartExample]:
    """One example per (query, relevant texts) pair, answers as numbered lines: the texts are
    the relevant documents' titles (``source="titles"``) or their texts (``openings`` /
    ``keywords``, without the corpus's boilerplate words ``noise``; a query whose documents give
    fewer than ``n_actions`` distinct lines is left out)."""
    if n_actions < 1:
        raise ValueError(f"n_actions must be >= 1 (got {n_actions}).")
    if source not in PSEUDO_SOURCES or source == "prf" or words < 1:
        raise ValueError(
            f"source must be one of {list(PSEUDO_SOURCES[:3])} and words >= 1 (prf: teacher_examples)"
        )
    rng = random.Random(seed)
    examples = []
    for query, texts in items:
        if source == "titles":
            lines = pseudo_rewrites(query, texts, n_actions, rng)
        else:
            lines = document_rewrites(texts, n_actions, rng, source, words, noise)
            if len(lines) < n_actions:
                continue
        answer = numbered(lines)
        examples.append(WarmstartExample(query=query, n_actions=n_actions, answer=answer))
    return examples


def numbered(lines: Sequence[str]) -> str:
    """The answer format: ``1. line`` … one numbered line per rewrite."""
    return "\n".join(f"{i}. {line}" for i, line in enumerate(lines, start=1))


def teacher_examples(
    queries: Sequence[str],
    contexts: Sequence[str],
    rewrites: Sequence[Sequence[str]],
    n_actions: int,
) -> list[WarmstartExample]:
    """The teacher's SFT pairs (source ``prf``): each query with its feedback context and
    keyword expansion's rewrites of it (`evaluator.feedback.FeedbackContext.teacher`) as the
    answer. A query whose top documents give fewer than ``n_actions`` lines (a first retrieval
    that found nothing: an empty context) has its keywords in the lines keyword expansion
    leaves empty, the only words it has: left out instead, such contexts were never seen, and
    the start answered them with strings of repeats ("1. 1. 1. 1."), 4 % of its TEST rewrites."""
    if n_actions < 1:
        raise ValueError(f"n_actions must be >= 1 (got {n_actions}).")
    if not len(queries) == len(contexts) == len(rewrites):
        raise ValueError(
            f"{len(queries)} queries, {len(contexts)} contexts and {len(rewrites)} rewrite lists"
        )
    return [
        WarmstartExample(query=q, n_actions=n_actions, answer=numbered(_filled(q, lines, n_actions)),
                         context=c)
        for q, c, lines in zip(queries, contexts, rewrites, strict=True)
    ]  # fmt: skip


def _filled(query: str, lines: Sequence[str], n_actions: int) -> list[str]:
    """``lines`` (at most ``n_actions``), the missing ones the query's keywords (the query itself
    when it has none)."""
    own = keywords(query) or " ".join(query.split())
    return [*lines[:n_actions], *[own] * (n_actions - len(lines))]


def encode_example(
    tokenizer: Any, example: WarmstartExample, max_length: int, prompt_style: str = "oneshot"
) -> tuple[list[int], list[int]]:
    """(input_ids, labels): prompt labelled IGNORE_INDEX, answer + end-of-turn supervised; cut
    at ``max_length`` (a cut example no longer ends with the end of turn: `warmstart` counts
    them in ``WarmstartMetrics.truncated``)."""
    prompt = build_prompt(
        tokenizer, example.query, example.n_actions, prompt_style, example.context
    )
    answer = list(tokenizer(example.answer, add_special_tokens=False)["input_ids"])
    answer.append(int(tokenizer.eos_token_id))
    ids = (prompt + answer)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt) + answer)[:max_length]
    return ids, labels


def _pad(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (input_ids, attention_mask, labels), each (B, L)."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return input_ids, mask, labels


def sft_loss(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, labels: Tensor
) -> tuple[Tensor, Tensor]:
    """Token-mean next-token cross-entropy over labelled tokens, and that token count.

    Logits are computed only from the first position that predicts a labelled token on (the
    prompts are unlabelled): the vocabulary projection is most of the cost at 49k tokens.
    """
    labelled = (labels != IGNORE_INDEX).any(0)  # (L,)
    first = int(labelled.to(torch.long).argmax()) if bool(labelled.any()) else labels.shape[1] - 1
    keep = labels.shape[1] - max(first - 1, 0)  # positions first-1 .. L-1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
    logits = logits[:, :-1]  # (B, keep-1, V): position p predicts token p+1
    target = labels[:, labels.shape[1] - keep + 1 :]  # (B, keep-1)
    count = (target != IGNORE_INDEX).sum()
    loss = nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss / count.clamp(min=1), count


def warmstart(
    model: nn.Module,
    tokenizer: Any,
    examples: Sequence[WarmstartExample],
    epochs: int = 1,
    max_steps: int | None = None,
    lr: float = 5e-5,
    batch_size: int = 8,
    seed: int = 0,
    max_length: int = 320,
    progress: Callable[[int, int, float], None] | None = None,
    prompt_style: str = "oneshot",
    train_precision: str = "float32",
    top_layers: int | None = None,
) -> WarmstartMetrics:
    """SFT ``model`` in place on ``examples`` (AdamW, shuffled per epoch); returns the loss curve.

    ``top_layers`` N: only the top N decoder layers and the final norm train (the embedding and
    the layers below stay as they are, and the backward stops at layer 30 - N); None: every
    weight trains.

    ``progress(step, total_steps, loss)`` is called after every optimizer step (wire a rich
    progress bar to it). ``prompt_style`` must be the one the policy will be prompted with
    (`short` teaches the format without the worked example); ``train_precision`` bfloat16 runs
    the forward under autocast (fp32 master weights). The model is left in eval mode.
    """
    from policy.update import autocast

    if not examples:
        raise ValueError("warmstart needs at least one example.")
    encoded = [encode_example(tokenizer, ex, max_length, prompt_style) for ex in examples]
    per_epoch = -(-len(encoded) // batch_size)
    total = min(per_epoch * epochs, max_steps) if max_steps is not None else per_epoch * epochs
    device = next(model.parameters()).device
    trained = list(model.parameters()) if top_layers is None else top_params(model, top_layers)
    frozen = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in trained)]
    for p in frozen:
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(trained, lr=lr)
    rng, metrics = random.Random(seed), WarmstartMetrics()
    eos = int(tokenizer.eos_token_id)
    metrics.truncated = sum(ids[-1] != eos for ids, _ in encoded)  # an uncut example ends in EOS
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    model.train()
    try:
        while metrics.steps < total:
            order = rng.sample(range(len(encoded)), len(encoded))
            for start in range(0, len(order), batch_size):
                if metrics.steps >= total:
                    break
                batch = _pad([encoded[i] for i in order[start : start + batch_size]], pad_id)
                input_ids, mask, labels = (t.to(device) for t in batch)
                with autocast(device, train_precision):
                    loss, count = sft_loss(model, input_ids, mask, labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                metrics.steps += 1
                metrics.tokens += int(count)
                metrics.losses.append(float(loss.detach()))
                if progress is not None:
                    progress(metrics.steps, total, metrics.losses[-1])
    finally:
        model.eval()
        for p in frozen:
            p.requires_grad_(True)
    return metrics
