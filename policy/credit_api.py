"""CASI's per-token advantages for any trainer: completions with action spans → per-action
credit → bounded zero-sum shaping → per-token advantages (docs/methods.md §2.7).

Read :func:`credit_advantages` first: the framework-neutral entry point. It takes a group-major
batch of completions (each with its query, its action texts and their token spans) and a
credit source, and returns the base advantage A_i on every token of a completion plus λ·x_ij on
the tokens of action j. It is the path `casi train` runs (`Trainer.train_step` calls
:func:`advantages_from_credit`, its second half, on its collated rollouts), and the TRL and verl
adapters (`casi_integrations`) call the same functions; none of it imports a trainer framework.

Credit sources (what turns the actions into a game):

* :class:`EnvironmentCredit` — CASI's environment: every action runs through the action cache and
  a retriever, every coalition list is scored (`evaluator.credit.compute_credits`, THE path);
* :class:`ValueFunctionCredit` — a game given as a callable v(i, S) over subsets;
* any callable ``(players, n_players) → CreditTables`` (e.g. the verl adapter's client of
  ``POST /v1/credits``, which builds its tables with :func:`game_credit`).

The two halves are also public for adapters that must gather a group across processes
(TRL): :func:`group_stage` (base A_i and shaped x_ij of whole groups) and :func:`token_stage`
(their tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from evaluator.actions import ActionExecutor
from evaluator.credit import RolloutActions, compute_credits, efficiency_violations
from evaluator.limits import MAX_PLAYERS
from evaluator.scorers import SetScorer
from evaluator.shapley import (
    broadcast,
    efficiency_residual,
    exact_shapley,
    leave_one_out,
    singleton,
)
from policy.advantages import (
    CreditTable,
    GroupAdvantages,
    ShapingConfig,
    group_advantages,
    shuffle_credits,
    token_advantages,
)

Span = tuple[int, int]


class CreditTables(Protocol):
    """What the shaping reads from a credit game (`evaluator.credit.CreditResult` has it):
    tensors padded to M players, float64, 0 at padded players."""

    @property
    def n_actions(self) -> Tensor: ...  # (R,) int64

    @property
    def values(self) -> Tensor: ...  # (R, 2^M) v(S) by bitmask

    @property
    def phi(self) -> Tensor: ...  # (R, M)

    @property
    def singleton(self) -> Tensor: ...  # (R, M)

    @property
    def leave_one_out(self) -> Tensor: ...  # (R, M)

    @property
    def broadcast(self) -> Tensor: ...  # (R, M)

    @property
    def value_full(self) -> Tensor: ...  # (R,) v(N), the completion's reward


CreditSource = Callable[[Sequence[RolloutActions], int], CreditTables]
"""``(players, n_players) → tables``: the game of every completion, padded to n_players."""


# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Completion:
    """One completion: its query, its actions and each action's token span [start, end) in the
    completion's own token indices; ``n_tokens`` = T_i, the tokens its advantages cover."""

    query_id: str
    query: str
    actions: tuple[str, ...]
    spans: tuple[Span, ...]
    n_tokens: int


def check_completions(
    completions: Sequence[Completion], n_actions: int, group_size: int, *, strict: bool = False
) -> None:
    """Refuse input that would misalign credit and tokens, naming completion i and action j.

    Errors: no completions; a count not a multiple of ``group_size``; more actions than
    ``n_actions``; spans and actions of different counts; an empty action text; a span that is
    empty, outside [0, n_tokens], or overlapping / before the previous one. Fewer actions than
    ``n_actions`` is the documented fallback (a partial game: the missing players are null,
    credit 0, no tokens) unless ``strict``.
    """
    if not completions:
        raise ValueError("no completions")
    if group_size < 1 or len(completions) % group_size:
        raise ValueError(f"{len(completions)} completions do not split into groups of {group_size}")
    if not 1 <= n_actions <= MAX_PLAYERS:
        raise ValueError(f"n_actions must be in 1..{MAX_PLAYERS}, got {n_actions}")
    for i, c in enumerate(completions):
        where = f"completion {i} (query {c.query_id!r})"
        if len(c.actions) != len(c.spans):
            raise ValueError(f"{where}: {len(c.actions)} actions but {len(c.spans)} spans")
        if len(c.actions) > n_actions or (strict and len(c.actions) < n_actions):
            raise ValueError(f"{where}: {len(c.actions)} actions, expected {n_actions}")
        end = 0
        for j, (text, (s, e)) in enumerate(zip(c.actions, c.spans, strict=True)):
            if not text.strip():
                raise ValueError(
                    f"{where}, action {j}: empty text (drop the action or give it text)"
                )
            if not end <= s < e <= c.n_tokens:
                raise ValueError(
                    f"{where}, action {j}: span [{s}, {e}) is empty, overlaps the previous one or "
                    f"lies outside the completion's {c.n_tokens} tokens"
                )
            end = e


@dataclass(frozen=True)
class SpanMasks:
    """The batch layout of spans: action slots (R, M) and their tokens (R, M, T), tokens (R, T)."""

    action_mask: Tensor
    action_token_mask: Tensor
    token_mask: Tensor


def span_masks(
    completions: Sequence[Completion], n_actions: int, width: int | None = None
) -> SpanMasks:
    """Masks of checked completions, right-padded to ``width`` tokens (default: the longest)."""
    width = max(c.n_tokens for c in completions) if width is None else width
    if width < max(c.n_tokens for c in completions):
        raise ValueError(f"width {width} is shorter than a completion")
    r = len(completions)
    action_mask = torch.zeros((r, n_actions), dtype=torch.bool)
    spans = torch.zeros((r, n_actions, width), dtype=torch.bool)
    tokens = torch.zeros((r, width), dtype=torch.bool)
    for i, c in enumerate(completions):
        tokens[i, : c.n_tokens] = True
        for j, (s, e) in enumerate(c.spans):
            action_mask[i, j] = True
            spans[i, j, s:e] = True
    return SpanMasks(action_mask, spans, tokens)


# ---------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class EnvironmentCredit:
    """CASI's environment as a credit source: `compute_credits` (cache, retriever, coalition
    lists, scorer, exact Shapley with the efficiency check), the path `casi train` runs."""

    executor: ActionExecutor
    scorer: SetScorer
    list_k: int
    anchor_query: bool = True

    def __call__(self, players: Sequence[RolloutActions], n_players: int) -> CreditTables:
        return compute_credits(
            players, self.executor, self.scorer, self.list_k,
            anchor_query=self.anchor_query, n_players=n_players,
        )  # fmt: skip


@dataclass(frozen=True)
class GameCredit:
    """The tables of a game given by its values (:func:`game_credit`), as `CreditTables`."""

    n_actions: Tensor
    values: Tensor
    phi: Tensor
    singleton: Tensor
    leave_one_out: Tensor
    broadcast: Tensor
    residual: Tensor  # (R,) Σφ − (v(N) − v(∅))
    cache: dict[str, int] | None = None  # the action cache's hits / misses, where the source knows

    @property
    def value_full(self) -> Tensor:
        return self.values[:, -1]


def game_credit(values: Tensor, n_actions: Tensor) -> GameCredit:
    """Exact Shapley and the baselines of value tables (R, 2^M) (docs/methods.md §1.5–1.6).

    Players at and past ``n_actions[i]`` must be null in row i (v(S ∪ {j}) = v(S)); their
    credits are set to exactly 0. Non-finite values or |Σφ − (v(N) − v(∅))| above
    1e-9 · max(1, max_S |v(S)|) raise `FloatingPointError`, as in `compute_credits`.
    """
    values = values.to(torch.float64)
    width = int(values.shape[-1]).bit_length() - 1
    phi = exact_shapley(values, width)  # (R, M)
    residual = efficiency_residual(values, phi)
    if bool(efficiency_violations(values, residual).any()):
        raise FloatingPointError(
            f"credit check failed: max |efficiency residual| {float(residual.abs().max()):.3g}"
        )
    real = (torch.arange(width)[None, :] < n_actions[:, None]).double()  # (R, M)
    return GameCredit(
        n_actions, values, phi * real, singleton(values, width) * real,
        leave_one_out(values, width) * real, broadcast(values, width) * real, residual,
    )  # fmt: skip


def pad_values(table: Sequence[float], n_real: int, n_players: int) -> Tensor:
    """A game of ``n_real`` players (2^n_real values) as one of ``n_players``: the extra players
    are null, v(S) = v(S ∩ real). (2^n_players,) float64. More real players than
    ``n_players`` is a `ValueError` (cutting the game would drop players), as in
    `compute_credits`."""
    _check_players(n_real, n_players)
    small = torch.as_tensor(table, dtype=torch.float64)
    if small.numel() != 2**n_real:
        raise ValueError(f"a game of {n_real} players has {2**n_real} values, got {small.numel()}")
    return small[torch.arange(2**n_players) & (2**n_real - 1)]


def _check_players(n_real: int, n_players: int, where: str = "a completion") -> None:
    if n_real > n_players:
        raise ValueError(f"{where} has {n_real} actions but n_players is {n_players}")


@dataclass(frozen=True)
class ValueFunctionCredit:
    """A game given as ``value(i, S)``: completion i's value of the subset S of its actions
    (indices into ``actions``). Called once per (completion, subset): 2^m calls each."""

    value: Callable[[int, frozenset[int]], float]

    def __call__(self, players: Sequence[RolloutActions], n_players: int) -> CreditTables:
        rows = []
        for i, p in enumerate(players):
            m = len(p.actions)
            _check_players(m, n_players, f"completion {i}")  # before its 2^m calls
            table = [
                float(self.value(i, frozenset(j for j in range(m) if mask >> j & 1)))
                for mask in range(2**m)
            ]
            rows.append(pad_values(table, m, n_players))
        counts = torch.tensor([len(p.actions) for p in players], dtype=torch.int64)
        return game_credit(torch.stack(rows), counts)


# ---------------------------------------------------------------------------- advantages


@dataclass(frozen=True)
class TokenAdvantages:
    """CASI's advantages of one batch: per group, per token, and the credit they came from."""

    base: Tensor  # (B, G) A_i
    x: Tensor  # (B, G, M) shaped credit, float64
    base_tok: Tensor  # (R, T) float32 A_i on every token of the mask
    shaping_tok: Tensor  # (R, T) float32 λ·x_ij on the tokens of action j
    token_adv: Tensor  # (R, T) float32 base_tok + shaping_tok: what a loss sees
    metrics: dict[str, Tensor]  # shaping diagnostics (clip_fraction, max_abs_rollout_sum)
    credit: CreditTables | None = None


def credit_table(
    credit: CreditTables, action_mask: Tensor, shuffle: torch.Generator
) -> CreditTable:
    """Every credit mode's (B, G, M) table; action_mask (B, G, M). ``shuffle`` draws the
    `shuffled` placebo's permutations (seeded per run and step: a resumed run replays them)."""

    def grouped(t: Tensor) -> Tensor:
        return t.reshape(action_mask.shape)

    phi = grouped(credit.phi)
    return CreditTable(
        shapley=phi, singleton=grouped(credit.singleton),
        leave_one_out=grouped(credit.leave_one_out), broadcast=grouped(credit.broadcast),
        shuffled=shuffle_credits(phi, action_mask, shuffle),
    )  # fmt: skip


def group_stage(
    credit: CreditTables,
    action_mask: Tensor,
    cfg: ShapingConfig,
    group_size: int,
    shuffle_seed: int,
) -> GroupAdvantages:
    """Base A_i over each group's v(N) and shaped x_ij of the configured mode; action_mask (R, M),
    rows group-major (B groups of ``group_size``)."""
    r, m = action_mask.shape
    mask = action_mask.reshape(r // group_size, group_size, m)
    table = credit_table(credit, mask, torch.Generator().manual_seed(shuffle_seed))
    return group_advantages(credit.value_full.reshape(mask.shape[:2]), table, mask, cfg)


def token_stage(
    base: Tensor, x: Tensor, action_token_mask: Tensor, token_mask: Tensor, lam: float
) -> tuple[Tensor, Tensor]:
    """(base_tok, shaping_tok) (R, T) float32: A_i on the masked tokens, λ·x_ij on action j's.
    base (R,), x (R, M), action_token_mask (R, M, T), token_mask (R, T) bool."""
    zero = torch.zeros(base.shape, dtype=base.dtype)
    shaping_tok = token_advantages(zero, x, action_token_mask, token_mask, lam).float()
    base_tok = base.reshape(-1, 1).float() * token_mask
    return base_tok, shaping_tok


def advantages_from_credit(
    credit: CreditTables,
    action_mask: Tensor,
    action_token_mask: Tensor,
    token_mask: Tensor,
    cfg: ShapingConfig,
    *,
    group_size: int,
    shuffle_seed: int,
) -> TokenAdvantages:
    """The shaping and the token mapping of a credited batch (what `Trainer.train_step` runs).

    action_mask (R, M) bool, action_token_mask (R, M, T) bool, token_mask (R, T) bool (the tokens
    a loss sees), rows group-major. ``shuffle_seed`` seeds the `shuffled` placebo's draw.
    """
    adv = group_stage(credit, action_mask, cfg, group_size, shuffle_seed)
    r, m = action_mask.shape
    base_tok, shaping_tok = token_stage(
        adv.base.reshape(r), adv.x.reshape(r, m), action_token_mask, token_mask, cfg.lam
    )
    return TokenAdvantages(
        adv.base, adv.x, base_tok, shaping_tok, base_tok + shaping_tok, adv.metrics, credit
    )


def credit_advantages(
    completions: Sequence[Completion],
    source: CreditSource,
    cfg: ShapingConfig,
    *,
    n_actions: int,
    group_size: int,
    width: int | None = None,
    shuffle_seed: int = 0,
    strict: bool = False,
) -> TokenAdvantages:
    """CASI's per-token advantages of a group-major batch of completions (docs/methods.md §2.7).

    ``n_actions`` = m (players per game; fewer is a partial game unless ``strict``),
    ``group_size`` = G, ``width`` = T (default: the longest completion). Returns (R, T) token
    advantages: A_i + λ·x_ij on the tokens of action j, A_i on the other tokens of completion i,
    0 past its ``n_tokens``. Bad input raises `ValueError` (:func:`check_completions`).
    """
    check_completions(completions, n_actions, group_size, strict=strict)
    players = [RolloutActions(c.query_id, c.query, list(c.actions)) for c in completions]
    credit = source(players, n_actions)
    masks = span_masks(completions, n_actions, width)
    return advantages_from_credit(
        credit, masks.action_mask, masks.action_token_mask, masks.token_mask, cfg,
        group_size=group_size, shuffle_seed=shuffle_seed,
    )  # fmt: skip
