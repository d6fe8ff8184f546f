"""Multi-action rollouts: one generation per sample → m retrieval actions with token spans.

Read `sample_rollouts` first (prompt → sampler → parser → `Rollout`), then `collate` (padded
tensors for the trainer and the loss stack). Teacher-forced log-probs of a batch come from the
ONE forward, `policy.forward.policy_forward` (or its no-grad helper `policy.forward.logprobs`).

Batch layout (`RolloutBatch`): every row is ``[left-padded prompt | right-padded response]``
of width P + T, so the response always occupies the last T columns and column P + t holds
response token t. Attention masks and position ids (counting only attended tokens) make the
padding invisible: log-probs do not depend on how much a row is padded. Pads in per-token
tensors are 0; always use ``response_mask``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from evaluator.limits import MAX_FEEDBACK_WORDS, MAX_PLAYERS
from policy.constrain import (
    CLS_FORCED,
    DEFAULT_LINE_CAP,
    FORMATS,
    MIN_LINE_CAP,
    FormatAutomaton,
    automaton_for,
    free_response_cap,
    trace,
)
from policy.model import policy_version as compute_policy_version
from policy.parse import Action, ParsedOutput, parse_actions
from policy.precision import build_sampler_model
from policy.prompts import (
    DEFAULT_FEEDBACK_WORDS,
    PROMPT_STYLES,
    ContextSource,
    build_prompt,
    check_contexts,
)
from policy.sampler import (
    SamplerConfig,
    default_stop_ids,
    generate,
    position_ids_from_mask,
)


@dataclass
class Rollout:
    """One sampled response to one query, with everything the trainer needs."""

    query: str
    query_id: str  # the dataset id of the query (its position as a string when none was given)
    query_index: int  # position of the query in the sample_rollouts call
    sample_index: int  # g in 0..G-1 within the query's group
    prompt_ids: list[int]
    response_ids: list[int]  # (T,) includes the stop token when finish_reason == "stop"
    sampler_logp: Tensor  # (T,) μ of each response token (tempered, untruncated)
    topk_logp: Tensor  # (T, K) top-K tempered log-probs of the sampler
    topk_ids: Tensor  # (T, K)
    parsed: ParsedOutput  # actions with spans in response-token indices, status, shared mask
    n_actions: int  # m asked for in the prompt
    policy_version: str  # version of the weights that sampled
    finish_reason: str  # "stop" | "length"
    precision: str  # sampler precision: float32 | bfloat16 | int8 | int8_weight
    temperature: float  # the recompute must use the same temperature
    automaton: FormatAutomaton | None = None  # the format constraint it was sampled under
    trunk: Tensor | None = None  # (p + T - 1, H) hidden state entering layer trunk_layer
    trunk_layer: int | None = None  # L of `trunk` (sample_rollouts(capture_layer=L)); None: none

    @property
    def format(self) -> str:
        return "free" if self.automaton is None else "constrained"

    @property
    def actions(self) -> list[Action]:
        return self.parsed.actions

    @property
    def action_texts(self) -> list[str]:
        return [a.text for a in self.parsed.actions]

    @property
    def status(self) -> str:
        return self.parsed.status


MIN_FREE_CAP = 8
"""Smallest free-format length cap (a numbered line needs a few tokens)."""


@dataclass(frozen=True)
class RolloutConfig:
    """What one generation is — m rewrites in a format, within caps, from a prompt style — for
    training and the held-out evaluation alike (`TrainConfig.rollout`, `EvalConfig.rollout`)."""

    n_actions: int = 4
    """m: rewrites asked for in one generation (players of the credit game), 1..12
    (evaluator.limits.MAX_PLAYERS: exact Shapley scores 2^m coalitions)."""
    format: str = "constrained"
    """constrained: every response is exactly m numbered non-empty lines, by construction, and
    μ, π_old, π and the reference are the constrained policy (docs/methods.md); free: whatever
    the model writes (malformed responses are partial games)."""
    line_cap: int = DEFAULT_LINE_CAP
    """Content tokens per rewrite line before the line is ended (constrained format); also
    sizes the free format's derived length cap."""
    max_new_tokens: int | None = None
    """Free format only: response length cap in tokens (>= 8); unset = derived from m and
    line_cap. The constrained format's cap is always derived (no answer is cut before its m-th
    line)."""
    prompt: str = "oneshot"
    """Prompt style: oneshot (with a worked example) | short (a format-trained policy) |
    feedback (the query and the words keyword expansion reads in its first retrieval's top
    documents; a policy warm-started on them)."""
    feedback_words: int = DEFAULT_FEEDBACK_WORDS
    """Prompt style feedback only: how many feedback words the prompt shows (1..64;
    evaluator.feedback)."""

    def __post_init__(self) -> None:
        if not 1 <= self.n_actions <= MAX_PLAYERS:
            raise ValueError(
                f"n_actions (m) must be in 1..{MAX_PLAYERS} (exact Shapley is 2^m), got {self.n_actions}"
            )
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got {self.format!r}")
        if self.line_cap < MIN_LINE_CAP:
            raise ValueError(f"line_cap must be >= {MIN_LINE_CAP}, got {self.line_cap}")
        if self.format != "free" and self.max_new_tokens is not None:
            raise ValueError(
                "max_new_tokens applies to format 'free' only: the constrained format's cap is "
                "derived from n_actions and line_cap (set line_cap instead)"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < MIN_FREE_CAP:
            raise ValueError(f"max_new_tokens must be >= {MIN_FREE_CAP}, got {self.max_new_tokens}")
        if self.prompt not in PROMPT_STYLES:
            raise ValueError(f"prompt must be one of {list(PROMPT_STYLES)}, got {self.prompt!r}")
        if not 1 <= self.feedback_words <= MAX_FEEDBACK_WORDS:
            raise ValueError(
                f"feedback_words must be in 1..{MAX_FEEDBACK_WORDS}, got {self.feedback_words}"
            )

    @property
    def needs_context(self) -> bool:
        """Whether every prompt needs its query's feedback context (prompt style feedback)."""
        return self.prompt == "feedback"

    @property
    def response_cap(self) -> int:
        """The sampler's length cap: the free format's (given, or derived from m and line_cap);
        a constrained generation stops by construction at its derived bound, never later."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return free_response_cap(self.n_actions, self.line_cap)


def contexts_for(
    rollout: RolloutConfig, source: ContextSource | None, queries: Sequence[str]
) -> list[str] | None:
    """The feedback contexts a rollout shape needs for ``queries`` (None: its prompt takes none)."""
    if not rollout.needs_context:
        return None
    if source is None:
        raise ValueError(
            "prompt style 'feedback' needs a feedback context source (the game's "
            "evaluator.feedback.FeedbackContext); none was given"
        )
    return source(list(queries), rollout.feedback_words, rollout.n_actions)


def sample_rollouts(
    model: nn.Module,
    tokenizer: Any,
    queries: list[str],
    n_samples: int,
    n_actions: int,
    config: SamplerConfig | None = None,
    policy_version: str | None = None,
    sampler_model: nn.Module | None = None,
    *,
    query_ids: Sequence[str] | None = None,
    prompt_style: str = "oneshot",
    format: str = "free",
    line_cap: int | None = None,
    capture_layer: int | None = None,
    contexts: Sequence[str] | None = None,
    refuse_degenerate: bool = False,
) -> list[Rollout]:
    """G = ``n_samples`` rollouts per query, query-major (query 0's G samples first).

    ``format``: "constrained" = every response is exactly ``n_actions`` numbered non-empty
    lines by construction (policy.constrain; ``line_cap`` content tokens per line, default
    `policy.constrain.DEFAULT_LINE_CAP`; the length cap is derived from m and ignores
    ``config.max_new_tokens``); "free" = whatever the model writes, up to max_new_tokens.

    ``sampler_model``: a prebuilt sampler (`build_sampler_model`) to reuse across calls; by
    default one is built from ``model`` at ``config.precision``. ``policy_version`` defaults to
    the content hash of ``model``. ``query_ids`` (default: positions) travel with each rollout.
    ``capture_layer`` L: each rollout keeps the sampler's hidden state entering decoder layer L
    (`Rollout.trunk`), for a run that trains only layers L.. (`params = top`).
    ``contexts``: each query's feedback context (`evaluator.feedback`), for ``prompt_style``
    feedback only. ``refuse_degenerate`` (greedy, constrained): no action is a string of
    repeats (`policy.constrain.RowConstraints.refuse_degenerate`).
    """
    if query_ids is not None and len(query_ids) != len(queries):
        raise ValueError(f"{len(query_ids)} query_ids for {len(queries)} queries")
    if not queries or n_samples < 1 or not 1 <= n_actions <= MAX_PLAYERS:
        raise ValueError(
            f"sample_rollouts needs queries, n_samples >= 1 and n_actions in 1..{MAX_PLAYERS}; "
            f"got {len(queries)} queries, n_samples {n_samples}, n_actions {n_actions}"
        )
    check_contexts(prompt_style, contexts, len(queries))
    ids = list(query_ids) if query_ids is not None else [str(i) for i in range(len(queries))]
    config = config or SamplerConfig()
    if sampler_model is None:
        sampler_model = build_sampler_model(model, config.precision, copy_weights=False)
    version = policy_version or compute_policy_version(model)
    stops = config.stop_token_ids or default_stop_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    ctx: Sequence[str | None] = contexts if contexts is not None else [None] * len(queries)
    prompts = [
        build_prompt(tokenizer, q, n_actions, prompt_style, c)
        for q, c in zip(queries, ctx, strict=True)
    ]
    rows = [(qi, g) for qi in range(len(queries)) for g in range(n_samples)]
    automaton = format_automaton(tokenizer, format, line_cap)
    generated = generate(
        sampler_model, [prompts[qi] for qi, _ in rows], config, stops, pad,
        automaton=automaton, n_actions=[n_actions] * len(rows), capture_layer=capture_layer,
        refuse_degenerate=refuse_degenerate,
    )  # fmt: skip
    return [
        Rollout(
            query=queries[qi],
            query_id=ids[qi],
            query_index=qi,
            sample_index=g,
            prompt_ids=prompts[qi],
            response_ids=out.response_ids,
            sampler_logp=out.logp,
            topk_logp=out.topk_logp,
            topk_ids=out.topk_ids,
            parsed=parse_actions(out.response_ids, tokenizer, n_actions, stop_token_ids=stops),
            n_actions=n_actions,
            policy_version=version,
            finish_reason=out.finish_reason,
            precision=config.precision,
            temperature=config.temperature,
            automaton=automaton,
            trunk=out.trunk,
            trunk_layer=capture_layer,
        )
        for (qi, g), out in zip(rows, generated, strict=True)
    ]


def format_automaton(
    tokenizer: Any, format: str, line_cap: int | None = None
) -> FormatAutomaton | None:
    """The tokenizer's format automaton for ``format`` "constrained", None for "free"."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    if format == "free":
        return None
    return automaton_for(tokenizer, DEFAULT_LINE_CAP if line_cap is None else line_cap)


@dataclass
class RolloutBatch:
    """Padded tensors of B rollouts. Shapes: P prompt width, T response width, M action slots."""

    input_ids: Tensor  # (B, P+T) int64
    attention_mask: Tensor  # (B, P+T) int64
    position_ids: Tensor  # (B, P+T) int64
    response_ids: Tensor  # (B, T) int64
    response_mask: Tensor  # (B, T) bool, True on real response tokens (stop token included)
    sampler_logp: Tensor  # (B, T) float32 μ
    topk_logp: Tensor  # (B, T, K) float32
    topk_ids: Tensor  # (B, T, K) int64
    action_token_mask: Tensor  # (B, M, T) bool, tokens of action j
    action_mask: Tensor  # (B, M) bool, action slot j exists
    shared_token_mask: Tensor  # (B, T) bool, response tokens in no action
    truncated: Tensor  # (B,) bool, finish_reason == "length"
    query_index: Tensor  # (B,) int64
    sample_index: Tensor  # (B,) int64
    policy_versions: list[str]
    loss_mask: Tensor  # (B, T) bool, response tokens the loss sees (forced tokens excluded)
    position_cls: Tensor  # (B, T) int64 format class of each position (constrained; else 0)
    forced_token: Tensor  # (B, T) int64 the forced token where position_cls = CLS_FORCED, else -1
    format_table: Tensor | None = None  # (C, V) bool allowed sets per class; None = free policy
    trunk: Tensor | None = None  # (B, P+T, H) the sampler's hidden state entering layer trunk_layer
    trunk_layer: int | None = None  # the forward runs layers trunk_layer.. on `trunk`; None: all

    @property
    def forced_mask(self) -> Tensor:
        """(B, T) bool: response positions where the format allowed exactly one token."""
        return self.response_mask & ~self.loss_mask

    @property
    def format_constraint(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """(table, classes, forced) for the constrained teacher-forced forward, or None."""
        if self.format_table is None:
            return None
        return self.format_table, self.position_cls, self.forced_token

    @property
    def trunk_input(self) -> tuple[Tensor, int] | None:
        """(hidden, L) for the teacher-forced forward of layers L.. only, or None."""
        if self.trunk is None or self.trunk_layer is None:
            return None
        return self.trunk, self.trunk_layer

    @property
    def prompt_width(self) -> int:
        return int(self.input_ids.shape[1] - self.response_ids.shape[1])

    def select(self, index: Tensor | slice | list[int]) -> RolloutBatch:
        """Rows ``index`` (e.g. a micro-batch), padding widths unchanged."""
        values: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("format_table", "trunk_layer"):  # shared by every row
                values[f.name] = value
            elif value is None:
                values[f.name] = None
            elif isinstance(value, Tensor):
                values[f.name] = value[index]
            elif isinstance(index, slice):
                values[f.name] = value[index]
            else:
                values[f.name] = [value[int(i)] for i in index]
        return replace(self, **values)

    def to(self, device: torch.device | str) -> RolloutBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }  # format_table too: the forward builds the allowed sets on the model's device
        return replace(self, **moved)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def collate(
    rollouts: list[Rollout], pad_token_id: int = 0, max_actions: int | None = None
) -> RolloutBatch:
    """Pad rollouts into a `RolloutBatch`; M = max_actions or the largest n_actions asked."""
    if not rollouts:
        raise ValueError("collate needs at least one rollout.")
    n, p_width = len(rollouts), max(len(r.prompt_ids) for r in rollouts)
    t_width = max(1, max(len(r.response_ids) for r in rollouts))
    k = max(int(r.topk_ids.shape[-1]) for r in rollouts)
    m = max_actions or max(r.n_actions for r in rollouts)
    input_ids = torch.full((n, p_width + t_width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, p_width + t_width), dtype=torch.long)
    response_mask = torch.zeros((n, t_width), dtype=torch.bool)
    sampler_logp = torch.zeros((n, t_width))
    topk_logp, topk_ids = (
        torch.zeros((n, t_width, k)),
        torch.zeros((n, t_width, k), dtype=torch.long),
    )
    action_token_mask = torch.zeros((n, m, t_width), dtype=torch.bool)
    action_mask = torch.zeros((n, m), dtype=torch.bool)
    position_cls, forced_token, table = _format_positions(rollouts, t_width)
    for i, r in enumerate(rollouts):
        p, t = len(r.prompt_ids), len(r.response_ids)
        input_ids[i, p_width - p : p_width] = torch.tensor(r.prompt_ids, dtype=torch.long)
        input_ids[i, p_width : p_width + t] = torch.tensor(r.response_ids, dtype=torch.long)
        attention_mask[i, p_width - p : p_width + t] = 1
        response_mask[i, :t] = True
        sampler_logp[i, :t] = r.sampler_logp
        topk_logp[i, :t, : r.topk_logp.shape[-1]] = r.topk_logp
        topk_ids[i, :t, : r.topk_ids.shape[-1]] = r.topk_ids
        for j, action in enumerate(r.actions[:m]):
            action_token_mask[i, j, action.token_start : action.token_end] = True
            action_mask[i, j] = True
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        response_ids=input_ids[:, p_width:].clone(),
        response_mask=response_mask,
        sampler_logp=sampler_logp,
        topk_logp=topk_logp,
        topk_ids=topk_ids,
        action_token_mask=action_token_mask,
        action_mask=action_mask,
        shared_token_mask=response_mask & ~action_token_mask.any(1),
        truncated=torch.tensor([r.finish_reason == "length" for r in rollouts]),
        query_index=torch.tensor([r.query_index for r in rollouts], dtype=torch.long),
        sample_index=torch.tensor([r.sample_index for r in rollouts], dtype=torch.long),
        policy_versions=[r.policy_version for r in rollouts],
        loss_mask=response_mask & (position_cls != CLS_FORCED),
        position_cls=position_cls,
        forced_token=forced_token,
        format_table=table,
        **_trunks(rollouts, p_width, t_width),
    )


def _trunks(rollouts: list[Rollout], p_width: int, t_width: int) -> dict[str, Any]:
    """The sampler's recorded hidden states in the batch layout (zeros at pads and at each
    row's last position, which predicts nothing), when every rollout has one of one layer."""
    layers = {r.trunk_layer for r in rollouts}
    if len(layers) != 1 or None in layers or any(r.trunk is None for r in rollouts):
        return {}
    first = rollouts[0].trunk
    assert first is not None
    trunk = torch.zeros((len(rollouts), p_width + t_width, first.shape[-1]), dtype=first.dtype)
    for i, r in enumerate(rollouts):
        assert r.trunk is not None
        p = len(r.prompt_ids)
        trunk[i, p_width - p : p_width - p + len(r.trunk)] = r.trunk
    return {"trunk": trunk, "trunk_layer": layers.pop()}


def _format_positions(rollouts: list[Rollout], width: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """(B, T) classes and forced tokens re-derived from the response tokens (docs/methods.md,
    format-constrained policy), and the class table; zeros / -1 / None for free rollouts."""
    cls = torch.zeros((len(rollouts), width), dtype=torch.long)
    forced = torch.full((len(rollouts), width), -1, dtype=torch.long)
    automata = {id(r.automaton): r.automaton for r in rollouts}
    if len(automata) > 1:
        raise ValueError("collate: rollouts of different formats cannot share a batch")
    automaton = next(iter(automata.values()))
    if automaton is None:
        return cls, forced, None
    for i, r in enumerate(rollouts):
        tr = trace(automaton, r.response_ids, r.n_actions)
        if not tr.valid:
            raise ValueError(f"rollout {i} is not a response of the constrained format")
        cls[i, : len(tr.cls)] = torch.tensor(tr.cls, dtype=torch.long)
        forced[i, : len(tr.forced)] = torch.tensor(tr.forced, dtype=torch.long)
    return cls, forced, automaton.table
