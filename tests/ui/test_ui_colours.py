"""Issue 27: the credit explorer coloured float noise as the strongest credit. A shaped x that
prints "+0.000" was darkest green and "−0.000" darkest red, because the shades were relative
to the sample's largest |value| even when that was noise (≈1e-8 after a group scale of ε).
Below `app.ui.colour.NEUTRAL_BELOW` a value is neutral and never sets the scale. Checked on the
function that maps a value to its colour, on the interaction matrix, and on the explorer page
rendered from a record (no server, no browser)."""

from __future__ import annotations

import math
import re

import pytest

from app.ui import charts
from app.ui.colour import NEUTRAL_BELOW, colour_scale, credit_class, credit_level
from app.ui.render import env, pages
from app.ui.svg import NEUTRAL, POSITIVE, interaction_matrix

NOISE = (1e-16, -1e-16, 2.2e-8, -2.2e-8, 3e-17, -4.9e-4)  # every one prints as ±0.000


def test_a_sample_of_noise_is_neutral_and_is_not_its_own_scale() -> None:
    scale = colour_scale(NOISE)
    assert scale == NEUTRAL_BELOW  # the floor, not max |noise| (4.9e-4) nor 1e-8
    assert [credit_class(v, scale) for v in NOISE] == ["c-zero"] * len(NOISE)
    assert all(f"{v:+.3f}" in ("+0.000", "-0.000") for v in NOISE)  # what the page prints


@pytest.mark.parametrize(
    ("value", "scale", "level"),
    [
        (0.8, 0.8, 4),  # the sample's largest: the darkest shade
        (-0.8, 0.8, -4),
        (0.6, 0.8, 3),  # 3/4 of the largest: 3 quarters
        (0.61, 0.8, 4),
        (0.2, 0.8, 1),  # 1/4: the lightest
        (-0.21, 0.8, -2),
        (NEUTRAL_BELOW, 0.8, 1),  # the tolerance itself is a (small) credit
        (math.nextafter(NEUTRAL_BELOW, 0.0), 0.8, 0),
        (-math.nextafter(NEUTRAL_BELOW, 0.0), 0.8, 0),
        (6e-4, 6e-4, 4),  # a real credit that is the sample's largest
        (1e-3, 1e-16, 4),  # a scale below the floor is floored, then capped at the top level
        (0.0, 0.8, 0),
    ],
)
def test_level_is_the_sign_and_the_quarter_of_the_scale(
    value: float, scale: float, level: int
) -> None:
    assert credit_level(value, scale) == level
    assert credit_level(-value, scale) == -level  # symmetric in the sign


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), "0.3", True])
def test_what_is_not_a_finite_number_is_neutral(value: object) -> None:
    assert credit_class(value, 1.0) == "c-zero"


def test_the_scale_is_the_largest_finite_magnitude_over_every_list() -> None:
    assert colour_scale([0.2, None, float("nan")], [-0.8, 1e-16], None) == 0.8
    assert colour_scale([], None) == NEUTRAL_BELOW
    assert [credit_class(v, 0.8) for v in (0.8, -0.3, 1e-16)] == ["c-pos4", "c-neg2", "c-zero"]


def _cells(svg: str) -> dict[tuple[int, int], tuple[str, float]]:
    """(j, k) → (fill, fill-opacity) of every cell of an interaction matrix."""
    found = re.findall(
        r'<g class="cell" data-j="(\d+)" data-k="(\d+)".*?fill="(#\w+)" fill-opacity="([\d.]+)"',
        svg,
    )
    return {(int(j), int(k)): (fill, float(alpha)) for j, k, fill, alpha in found}


def test_interaction_noise_is_grey_and_does_not_set_the_opacity() -> None:
    noise, real = 1e-16, 0.3
    matrix = [[0.0, noise, -3e-9], [noise, 0.0, real], [-3e-9, real, 0.0]]
    cells = _cells(interaction_matrix(matrix, chart_id="m"))
    assert len(cells) == 9
    assert cells[(0, 1)] == cells[(1, 0)] == cells[(0, 2)] == (NEUTRAL, 0.12)
    assert cells[(1, 2)] == (POSITIVE, 1.0)  # the largest real interaction: full opacity
    only_noise = _cells(interaction_matrix([[0.0, -noise], [-noise, 0.0]], chart_id="n"))
    assert {fill for fill, _ in only_noise.values()} == {NEUTRAL}  # was NEGATIVE at full opacity


def _record() -> dict[str, object]:
    """An additive game (each rewrite adds its own weight; rewrite 3 is a null player): the
    interactions are 0, and the shaped x are what centring equal credits and dividing by the
    group scale's ε leaves (noise), as seen in the issue."""
    weights = (0.3, -0.1, 0.0)
    table = [0.2 + sum(w for j, w in enumerate(weights) if s >> j & 1) for s in range(8)]
    return {
        "id": 7, "sample_index": 0, "format_status": "ok", "m": 3,
        "actions": ["aspirin", "heart", "attack"], "value_table": table,
        "v_empty": table[0], "v_full": table[-1], "phi": [0.3, -0.1, 1e-17],
        "singleton": [0.3, -0.1, 0.0], "leave_one_out": [0.3, -0.1, -2e-17],
        "base": 0.0, "shaped": [2.2e-8, -2.2e-8, 1e-16], "residual": 1e-17,
        "evaluator": "ndcg", "anchor": True, "hits": None,
    }  # fmt: skip


def test_the_explorer_page_colours_real_credit_and_greys_noise() -> None:
    rec = _record()
    lam = 0.5
    rec.update(figures=charts.sample_figures(rec), token_adv=charts.token_advantages(rec, lam))
    rec["lam"] = lam
    html = env.get_template("explorer.html").render(
        who=None, is_admin=False, csrf="", info={"id": 1, "name": "r", "credit": "shapley"},
        step=3, prev_step=None, next_step=None, total=1, per=4, pager=pages(1, 4, 0),
        groups=[{"query_id": "q1", "query_text": "aspirin", "samples": [rec]}],
    )  # fmt: skip
    classes: dict[str, list[str]] = {}
    for column, cls in re.findall(r'<td class="num ([\w-]+) (c-\w+)"', html):
        classes.setdefault(column, []).append(cls)
    assert classes["phi"] == ["c-pos4", "c-neg2", "c-zero"]
    assert classes["singleton"] == ["c-pos4", "c-neg2", "c-zero"]
    assert classes["loo"] == ["c-pos4", "c-neg2", "c-zero"]
    assert classes["shaped"] == ["c-zero"] * 3  # was c-pos4, c-neg4: "+0.000" darkest green
    assert classes["token-adv"] == ["c-zero"] * 3  # A + λx = ±1.1e-8
    assert {fill for fill, _ in _cells(html).values()} == {NEUTRAL}  # no interaction here
    note = re.search(r'<p class="note" id="colour-note">(.*?)</p>', html)
    assert note is not None and f"&lt; {NEUTRAL_BELOW}" in note.group(1)
    assert "neutral" in note.group(1)
