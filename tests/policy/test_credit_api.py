"""The framework-neutral entry point (`policy.credit_api`): closed-form games through the whole
path, the partial-game fallback, and bad input refused with the completion and action named."""

from __future__ import annotations

import pytest
import torch

from evaluator.credit import RolloutActions, efficiency_violations
from evaluator.shapley import shapley_by_permutations
from policy.advantages import CREDIT_MODES, ShapingConfig, group_advantages, token_advantages
from policy.credit_api import (
    Completion,
    ValueFunctionCredit,
    check_completions,
    credit_advantages,
    credit_table,
    game_credit,
    pad_values,
)

WEIGHTS = [[0.5, 0.1, 0.0], [0.2, 0.2, 0.3]]  # additive parts of each query's game


def _value(i: int, s: frozenset[int]) -> float:
    """Additive + a pair bonus for actions {0, 1}: φ splits the bonus equally."""
    w = WEIGHTS[i // 2]
    return 0.1 + sum(w[j] for j in s) + (0.2 if {0, 1} <= s else 0.0)


def _completions() -> list[Completion]:
    """2 groups of 2; completion 3 is partial (2 of 3 actions); spans leave shared tokens."""
    full = (("a", "b", "c"), ((1, 3), (4, 6), (7, 9)), 10)
    part = (("a", "b"), ((1, 3), (4, 5)), 7)
    rows = [full, full, full, part]
    return [
        Completion(f"q{i // 2}", f"query {i // 2}", a, s, n) for i, (a, s, n) in enumerate(rows)
    ]


@pytest.mark.parametrize("mode", CREDIT_MODES)
def test_entry_point_equals_the_steps_it_composes(mode: str) -> None:
    cfg = ShapingConfig(credit=mode, lam=0.5)  # type: ignore[arg-type]
    comps = _completions()
    out = credit_advantages(
        comps, ValueFunctionCredit(_value), cfg, n_actions=3, group_size=2, shuffle_seed=5
    )
    # by hand: the value table, φ by permutations, the shaping, the token map
    values = torch.tensor(
        [[_value(i, frozenset(j for j in range(len(c.actions)) if m >> j & 1)) for m in range(8)]
         for i, c in enumerate(comps)], dtype=torch.float64,
    )  # fmt: skip
    phi = shapley_by_permutations(values, 3) * torch.tensor([[1, 1, 1]] * 3 + [[1, 1, 0]])
    torch.testing.assert_close(out.credit.phi, phi, atol=1e-12, rtol=0)
    mask = torch.tensor([[True] * 3] * 3 + [[True, True, False]]).reshape(2, 2, 3)
    table = credit_table(out.credit, mask, torch.Generator().manual_seed(5))
    adv = group_advantages(values[:, -1].reshape(2, 2), table, mask, cfg)
    spans = torch.zeros(4, 3, 10, dtype=torch.bool)
    for i, c in enumerate(comps):
        for j, (s, e) in enumerate(c.spans):
            spans[i, j, s:e] = True
    tokens = torch.arange(10)[None, :] < torch.tensor([10, 10, 10, 7])[:, None]
    expected = token_advantages(adv.base.reshape(4), adv.x.reshape(4, 3), spans, tokens, 0.5)
    torch.testing.assert_close(out.token_adv, expected.float(), atol=1e-6, rtol=0)
    assert out.token_adv[3, 7:].abs().max() == 0  # past the partial completion's tokens
    if mode != "broadcast":
        assert out.shaping_tok.abs().max() > 0.1


def test_closed_form_credit_of_the_pair_game() -> None:
    out = game_credit(torch.stack([pad_values([_value(0, frozenset(j for j in range(3) if m >> j & 1))
                                               for m in range(8)], 3, 3)]), torch.tensor([3]))  # fmt: skip
    torch.testing.assert_close(out.phi, torch.tensor([[0.6, 0.2, 0.0]], dtype=torch.float64))
    assert float(out.residual.abs().max()) < 1e-12


def test_a_partial_game_pads_null_players() -> None:
    small = [0.1, 0.4, 0.3, 0.7]  # 2 players
    padded = pad_values(small, 2, 4)  # 4 players: the last two null
    out = game_credit(padded[None], torch.tensor([2]))
    ref = game_credit(torch.tensor([small], dtype=torch.float64), torch.tensor([2]))
    torch.testing.assert_close(out.phi[:, :2], ref.phi, atol=1e-15, rtol=0)
    assert out.phi[0, 2:].tolist() == [0.0, 0.0]


def _bad(**kw: object) -> list[Completion]:
    base = dict(query_id="q", query="text", actions=("a", "b"), spans=((0, 2), (3, 5)), n_tokens=6)
    return [Completion(**{**base, **kw})] * 2  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"spans": ((0, 2), (3, 7))}, "outside the completion's 6 tokens"),
        ({"spans": ((0, 2), (2, 2))}, "span \\[2, 2\\) is empty"),
        ({"spans": ((0, 3), (2, 5))}, "overlaps the previous one"),
        ({"actions": ("a", "  ")}, "action 1: empty text"),
        ({"spans": ((0, 2),)}, "2 actions but 1 spans"),
        ({"actions": ("a", "b", "c"), "spans": ((0, 1), (2, 3), (4, 5))}, "3 actions, expected 2"),
    ],
)
def test_bad_input_names_the_completion_and_action(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        check_completions(_bad(**kw), n_actions=2, group_size=2)
    assert "completion 0 (query 'q')" in str(err.value)


def test_fewer_actions_than_m_is_a_partial_game_unless_strict() -> None:
    comps = _bad(actions=("a",), spans=((0, 2),))
    check_completions(comps, n_actions=2, group_size=2)  # the documented fallback
    with pytest.raises(ValueError, match="1 actions, expected 2"):
        check_completions(comps, n_actions=2, group_size=2, strict=True)
    with pytest.raises(ValueError, match="groups of 3"):
        check_completions(comps, n_actions=2, group_size=3)


def test_non_finite_or_inefficient_games_are_refused() -> None:
    with pytest.raises(FloatingPointError):
        game_credit(torch.tensor([[0.0, float("nan")]]), torch.tensor([1]))
    with pytest.raises(ValueError, match="has 4 values"):
        pad_values([0.0, 1.0], 2, 3)


def test_more_actions_than_players_is_refused_not_cut() -> None:
    """A game is never cut to n_players: the dropped players' value would vanish silently."""
    with pytest.raises(ValueError, match="has 3 actions but n_players is 2"):
        pad_values([0.0] * 8, 3, 2)
    calls: list[int] = []

    def value(i: int, s: frozenset[int]) -> float:
        calls.append(i)
        return float(len(s))

    source = ValueFunctionCredit(value)
    players = [RolloutActions("q", "query", ["a", "b", "c"])]
    with pytest.raises(ValueError, match="completion 0 has 3 actions but n_players is 2"):
        source(players, 2)
    assert not calls  # refused before its 2^m calls


def test_the_efficiency_check_is_relative_to_the_games_scale() -> None:
    """Rounding grows with |v|: a game of values near 1e8 has residuals near 1e-8, above an
    absolute 1e-9; the check holds it to 1e-9 · max|v|."""
    gen = torch.Generator().manual_seed(0)
    big = torch.rand((64, 2**5), generator=gen, dtype=torch.float64) * 1e8
    out = game_credit(big, torch.full((64,), 5))
    assert out.residual.abs().max() > 1e-9  # an absolute 1e-9 would refuse these games
    torch.testing.assert_close(out.phi.sum(-1), big[:, -1] - big[:, 0], rtol=1e-12, atol=1e-6)
    assert not efficiency_violations(big, out.residual).any()
    # still refused: a residual above the relative bound, a non-finite table
    bad = efficiency_violations(
        torch.tensor([[0.0, 1.0], [0.0, 1e8], [0.0, float("inf")]], dtype=torch.float64),
        torch.tensor([2e-9, 0.2, 0.0], dtype=torch.float64),
    )
    assert bad.tolist() == [True, True, True]
