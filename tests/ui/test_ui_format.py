"""Issue 27: numbers and charts of the dashboard, without a server. Metrics keep their precision
(significant digits, not four decimals that print a learning rate of 1e-5 as 0.0000); curves
that coincide stay visible (each series its own dash pattern and marker); a step axis has
whole-number ticks only."""

from __future__ import annotations

import re

import pytest

from app.ui.render import env, fmt
from app.ui.svg import Series, line_chart


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (1e-5, "1e-05"),  # a learning rate
        (2.9e-9, "2.9e-09"),  # a gradient norm
        (4.6e-18, "4.6e-18"),  # a loss
        (0.0, "0"),
        (-0.0, "0"),
        (0, "0"),
        (0.68634, "0.6863"),  # nDCG keeps its four digits
        (-0.012345, "-0.01235"),
        (1.0, "1"),
        (9.53, "9.53"),
        (1234.56, "1235"),
        (123456.7, "123457"),  # whole above 10^4, not 1.235e+05
        (3.2e7, "3.2e+07"),
        (7, "7"),  # an integer stays whole
        (True, "yes"),
        (None, "—"),
        (float("nan"), "—"),
        (float("inf"), "—"),
    ],
)
def test_metrics_keep_their_precision(value: object, shown: str) -> None:
    assert fmt(value) == shown
    assert fmt(value, 4) == shown


def test_the_latest_metrics_table_prints_significant_digits() -> None:
    metrics = {"lr": 1e-5, "grad_norm": 2.9e-9, "loss": 4.6e-18, "zero": 0.0, "reward": 0.61234}
    html = env.from_string(
        '{% for k, v in m|dictsort %}<td id="{{ k }}">{{ v|fmt(4) }}</td>{% endfor %}'
    ).render(m=metrics)
    cells = dict(re.findall(r'<td id="(\w+)">([^<]*)</td>', html))
    assert cells == {"grad_norm": "2.9e-09", "loss": "4.6e-18", "lr": "1e-05", "reward": "0.6123",
                     "zero": "0"}  # fmt: skip
    assert "0.0000" not in html


def _series_style(svg: str) -> dict[int, tuple[str, str]]:
    """Each series' (dash pattern, marker shape) as the chart draws them."""
    dashes = {}
    for tag in re.findall(r'<polyline class="series"[^>]*>', svg):
        i = int(re.search(r'data-series="(\d+)"', tag).group(1))  # type: ignore[union-attr]
        dash = re.search(r'stroke-dasharray="([^"]*)"', tag)
        dashes[i] = dash.group(1) if dash else ""
    shapes: dict[int, set[str]] = {}
    for shape, i in re.findall(r'class="pt" data-marker="(\w+)" data-series="(\d+)"', svg):
        shapes.setdefault(int(i), set()).add(shape)
    assert all(len(s) == 1 for s in shapes.values()), shapes  # one shape per series
    return {i: (dashes[i], next(iter(shapes[i]))) for i in dashes}


def test_coinciding_runs_each_have_their_own_dash_and_marker() -> None:
    """Three runs with the same numbers (the overlay page's case): three curves drawn, each
    distinguishable; the legend shows each one's dash and marker."""
    same = [Series(f"run {i}", [1, 2, 3, 4], [0.5, 0.55, 0.6, 0.62]) for i in (1, 2, 3)]
    svg = line_chart(same, title="reward v(N)", chart_id="overlay-reward")
    styles = _series_style(svg)
    assert sorted(styles) == [0, 1, 2]
    assert len(set(styles.values())) == 3, styles
    assert len({dash for dash, _ in styles.values()}) == 3  # a dash pattern each
    assert len({shape for _, shape in styles.values()}) == 3  # a marker each
    assert len(re.findall(r'class="pt"', svg)) == 3 * 4
    keys = re.findall(r'<g class="key" data-series="(\d)">(.*?)</g>', svg)
    assert [int(i) for i, _ in keys] == [0, 1, 2]
    for i, key in keys:
        dash, shape = styles[int(i)]
        assert f'data-marker="{shape}"' in key
        assert (f'stroke-dasharray="{dash}"' in key) == bool(dash)


@pytest.mark.parametrize(
    "steps", [[1, 2, 3], [1, 2], [5], [0, 1, 2, 3, 4, 5, 6, 7], [1, 30], list(range(0, 2001, 50))]
)
def test_a_step_axis_has_whole_number_ticks(steps: list[int]) -> None:
    svg = line_chart([Series("reward", steps, [0.5] * len(steps))], title="t", chart_id="c")
    ticks = re.findall(r'text-anchor="middle" class="tick(?: xtick)?">([^<]+)<', svg)
    assert ticks, svg
    assert all(float(t).is_integer() for t in ticks), ticks
    assert len(ticks) == len(set(ticks))
