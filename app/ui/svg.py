"""Inline SVG charts of the dashboard, drawn here (no front-end library), as the audit report
draws its figures (:mod:`app.reports.audit_plots`).

Read :func:`line_chart` (curves of a run, several runs overlaid), :func:`value_bars` (the value
table v(S) as a sorted bar chart) and :func:`interaction_matrix` (pairwise Shapley interaction).
Every text is escaped here: the returned markup is inserted into the templates as it is. No
``style`` attribute is written (the Content-Security-Policy allows no inline style): colours
are presentation attributes (``fill``, ``stroke``, ``fill-opacity``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from app.ui.colour import colour_scale, credit_level

PALETTE = ("#1565c0", "#c62828", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f", "#5d4037", "#ad1457")
POSITIVE, NEGATIVE, NEUTRAL = "#2e7d32", "#c62828", "#9e9e9e"
MAX_POINTS = 600  # per series: longer curves are thinned evenly (the last point is kept)
MAX_MARKERS = 150  # per series: data-point markers only up to this many points
# Each series of a chart has its own dash pattern and marker shape besides its colour, so
# curves that coincide (two runs with the same numbers) stay visible: a dashed curve over a
# solid one shows both colours, a hollow square around a filled dot both markers.
DASHES = ("", "7 3", "2 2", "9 3 2 3", "4 4", "1 3", "12 4", "5 2 1 2")
MARKERS = ("circle", "square", "triangle", "diamond", "down", "plus", "cross", "ring")


@dataclass(frozen=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]


def _num(v: float) -> str:
    return f"{v:.1f}"


def _tick(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000 or a < 0.01:
        return f"{v:.1e}"
    return f"{v:.3g}"


def _nice_ticks(lo: float, hi: float, n: int = 5, *, integer: bool = False) -> list[float]:
    """About ``n`` round ticks over [lo, hi] (1, 2, 2.5 or 5 × a power of ten apart);
    ``integer``: whole numbers only (a step axis: never a tick at step 1.5)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        lo, hi = lo - 0.5, lo + 0.5
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    steps = [m * mag for m in (1, 2, 2.5, 5, 10)]
    if integer:
        steps = [max(1, round(s)) for s in steps if s >= 1 and float(s).is_integer()] or [1]
    step = next((s for s in steps if s >= raw), steps[-1])
    start = math.floor(lo / step) * step
    ticks: list[float] = []
    t = start
    while t <= hi + step * 0.5 and len(ticks) < 12:
        ticks.append(round(t, 12))
        t += step
    return ticks


def marker(
    shape: str, x: float, y: float, colour: str, *, cls: str = "pt", attrs: str = "",
    title: str = "",
) -> str:  # fmt: skip
    """One marker of shape ``shape`` (:data:`MARKERS`) centred on (x, y), with ``data-marker``
    its shape and ``title`` (escaped by the caller) as its tooltip. Only the first shape (a
    small dot) is filled; the others are outlines, each a little larger than the one before,
    so markers drawn at the same place all stay visible."""
    head = f'class="{cls}" data-marker="{shape}"' + (f" {attrs}" if attrs else "")
    inner = f"<title>{title}</title>" if title else ""
    hollow = f'fill="none" stroke="{colour}" stroke-width="1.2"'
    if shape in ("circle", "ring"):
        r, paint = (2.6, f'fill="{colour}"') if shape == "circle" else (6.0, hollow)
        return f'<circle {head} cx="{_num(x)}" cy="{_num(y)}" r="{r}" {paint}>{inner}</circle>'
    r = {"square": 3.6, "triangle": 4.6, "diamond": 5.4, "down": 5.2}.get(shape, 6.0)
    corners = {
        "square": ((-r, -r), (r, -r), (r, r), (-r, r)),
        "triangle": ((0, -r), (r, r * 0.75), (-r, r * 0.75)),
        "diamond": ((0, -r), (r, 0), (0, r), (-r, 0)),
        "down": ((-r, -r * 0.75), (r, -r * 0.75), (0, r)),
    }.get(shape)
    if corners is not None:
        d = "M" + " L".join(f"{_num(x + dx)},{_num(y + dy)}" for dx, dy in corners) + " Z"
        paint = hollow
    else:  # plus, cross: strokes only
        a: tuple[tuple[float, float], ...] = ((-r, 0.0), (r, 0.0))
        b: tuple[tuple[float, float], ...] = ((0.0, -r), (0.0, r))
        if shape == "cross":
            a, b = ((-r, -r), (r, r)), ((-r, r), (r, -r))
        d = " ".join(
            f"M{_num(x + p[0])},{_num(y + p[1])} L{_num(x + q[0])},{_num(y + q[1])}"
            for p, q in (a, b)
        )
        paint = f'fill="none" stroke="{colour}" stroke-width="1.4"'
    return f'<path {head} d="{d}" {paint}>{inner}</path>'


def _thin(xs: Sequence[float], ys: Sequence[float]) -> list[tuple[float, float]]:
    pts = [(float(x), float(y)) for x, y in zip(xs, ys, strict=True) if math.isfinite(float(y))]
    if len(pts) <= MAX_POINTS:
        return pts
    stride = math.ceil(len(pts) / MAX_POINTS)
    kept = pts[::stride]
    return kept if kept[-1] == pts[-1] else [*kept, pts[-1]]


def line_chart(
    series: Sequence[Series], *, title: str, chart_id: str, width: int = 440, height: int = 230
) -> str:
    """Curves on shared axes: one polyline per series plus a marker per data point (each with
    its value as a tooltip and ``data-x`` / ``data-y``); an empty chart says so."""
    data = [(s, _thin(s.xs, s.ys)) for s in series]
    data = [(s, p) for s, p in data if p]
    rows = math.ceil(len(data) / 2)
    height += 14 * max(0, rows - 1)
    left, right, top, bottom = 56, 12, 28, 36 + 14 * max(1, rows)
    pw, ph = width - left - right, height - top - bottom
    head = (
        f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>"
        f'<text x="{left}" y="16" class="chart-title">{escape(title)}</text>'
    )
    if not data:
        return (
            head + f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" '
            f'stroke="#e0e0e0"/><text x="{left + pw / 2}" y="{top + ph / 2}" '
            'text-anchor="middle" class="muted">no data</text></svg>'
        )
    xs = [x for _, p in data for x, _ in p]
    ys = [y for _, p in data for _, y in p]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    yt = _nice_ticks(min(ys), max(ys))
    y0, y1 = min(yt[0], min(ys)), max(yt[-1], max(ys))
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    parts = [
        head,
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="#bdbdbd"/>',
    ]
    for t in yt:
        if y0 <= t <= y1:
            y = _num(py(t))
            parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y}" y2="{y}" stroke="#eeeeee"/>')
            parts.append(
                f'<text x="{left - 4}" y="{y}" text-anchor="end" dy="0.32em" class="tick">{_tick(t)}</text>'
            )
    for t in _nice_ticks(x0, x1, 6, integer=True):
        if x0 <= t <= x1:
            x = _num(px(t))
            parts.append(
                f'<line x1="{x}" x2="{x}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#757575"/>'
            )
            parts.append(
                f'<text x="{x}" y="{top + ph + 15}" text-anchor="middle" class="tick xtick">{_tick(t)}</text>'
            )
    parts.append(
        f'<text x="{left + pw}" y="{top + ph + 28}" text-anchor="end" class="tick">step</text>'
    )
    for i, (s, pts) in enumerate(data):
        colour = PALETTE[i % len(PALETTE)]
        dash, shape = DASHES[i % len(DASHES)], MARKERS[i % len(MARKERS)]
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        coords = " ".join(f"{_num(px(x))},{_num(py(y))}" for x, y in pts)
        parts.append(
            f'<polyline class="series" data-series="{i}" fill="none" stroke="{colour}" '
            f'stroke-width="1.6"{dashed} points="{coords}"/>'
        )
        if len(pts) <= MAX_MARKERS:
            label = escape(s.label)
            parts.extend(
                marker(
                    shape,
                    px(x),
                    py(y),
                    colour,
                    title=f"{label}: step {x:g} → {y:.4g}",
                    attrs=f'data-series="{i}" data-x="{x:g}" data-y="{y:.6g}"',
                )  # fmt: skip
                for x, y in pts
            )
        lx, ly = left + (i % 2) * (pw / 2), top + ph + 42 + 14 * (i // 2)
        parts.append(
            f'<g class="key" data-series="{i}"><line x1="{_num(lx)}" x2="{_num(lx + 18)}" '
            f'y1="{ly - 4}" y2="{ly - 4}" stroke="{colour}" stroke-width="1.6"{dashed}/>'
            + marker(shape, lx + 9, ly - 4, colour, cls="key-pt")
            + f'<text x="{_num(lx + 22)}" y="{ly}" class="legend">{escape(s.label[:34])}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def coalition_label(mask: int, m: int) -> str:
    """``{1,3}`` (rewrites numbered from 1) or ``∅``."""
    members = [str(j + 1) for j in range(m) if mask >> j & 1]
    return "{" + ",".join(members) + "}" if members else "∅"


def value_bars(values: Sequence[float], m: int, *, chart_id: str, max_bars: int = 40) -> str:
    """v(S) of every coalition as horizontal bars, sorted high → low; ∅ and N marked. Past
    ``max_bars`` coalitions the top and bottom ones are shown and the rest counted."""
    order = sorted(range(len(values)), key=lambda s: (-values[s], s))
    hidden = 0
    if len(order) > max_bars:
        keep = max_bars - 8
        hidden = len(order) - max_bars
        order = order[:keep] + order[-8:]
    bar_h, left, width = 14, 64, 420
    height = 24 + bar_h * len(order) + (bar_h if hidden else 0)
    lo, hi = min(0.0, min(values)), max(0.0, max(values))
    span = (hi - lo) or 1.0
    pw = width - left - 60

    def px(v: float) -> float:
        return left + (v - lo) / span * pw

    full = (1 << m) - 1
    parts = [
        f'<svg class="chart bars" id="{escape(chart_id)}" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="value table v(S), sorted"><title>value table v(S)</title>'
        f'<text x="{left}" y="14" class="chart-title">v(S), sorted</text>'
    ]
    y = 22
    for n, s in enumerate(order):
        if hidden and n == len(order) - 8:
            parts.append(
                f'<text x="{left}" y="{y + 10}" class="muted">… {hidden} more coalitions …</text>'
            )
            y += bar_h
        v = float(values[s])
        x_a, x_b = sorted((px(0.0), px(v)))
        colour = "#616161" if s in (0, full) else "#1565c0"
        label = coalition_label(s, m) + (" = N" if s == full and m > 0 else "")
        parts.append(
            f'<g class="bar" data-coalition="{s}" data-value="{v:.6g}"><title>v({label}) = {v:.4f}</title>'
            f'<text x="{left - 4}" y="{y + 10}" text-anchor="end" class="tick">{escape(label)}</text>'
            f'<rect x="{_num(x_a)}" y="{y}" width="{_num(max(0.5, x_b - x_a))}" height="{bar_h - 3}" fill="{colour}"/>'
            f'<text x="{_num(max(x_b, px(0.0)) + 4)}" y="{y + 10}" class="tick">{v:.3f}</text></g>'
        )
        y += bar_h
    parts.append("</svg>")
    return "".join(parts)


def interaction_matrix(matrix: Sequence[Sequence[float]], *, chart_id: str) -> str:
    """The m × m pairwise interaction I_jk as a grid: green = complementary (> 0), red =
    redundant (< 0), opacity = |I| relative to the largest (`app.ui.colour`: below its
    NEUTRAL_BELOW a value is grey and never sets the scale); the value in each cell."""
    m = len(matrix)
    cell, left, top = 44, 28, 30
    size = left + cell * m + 8
    peak = colour_scale(*matrix)
    parts = [
        f'<svg class="chart matrix" id="{escape(chart_id)}" viewBox="0 0 {size} {top + cell * m + 8}" '
        f'width="{size}" height="{top + cell * m + 8}" role="img" aria-label="pairwise interaction">'
        "<title>pairwise Shapley interaction</title>"
        f'<text x="{left}" y="12" class="chart-title">interaction I(j,k)</text>'
    ]
    for j in range(m):
        parts.append(
            f'<text x="{left + cell * j + cell / 2}" y="{top - 4}" text-anchor="middle" class="tick">{j + 1}</text>'
        )
        parts.append(
            f'<text x="{left - 6}" y="{top + cell * j + cell / 2}" dy="0.32em" text-anchor="end" class="tick">{j + 1}</text>'
        )
        for k in range(m):
            v = float(matrix[j][k])
            level = credit_level(v, peak)
            colour = POSITIVE if level > 0 else NEGATIVE if level < 0 else NEUTRAL
            alpha = 0.08 if j == k else 0.12 + 0.88 * (min(1.0, abs(v) / peak) if level else 0.0)
            parts.append(
                f'<g class="cell" data-j="{j}" data-k="{k}" data-value="{v:.6g}"><title>I({j + 1},{k + 1}) = {v:+.4f}</title>'
                f'<rect x="{left + cell * k}" y="{top + cell * j}" width="{cell - 2}" height="{cell - 2}" '
                f'fill="{colour}" fill-opacity="{alpha:.2f}"/>'
                f'<text x="{left + cell * k + cell / 2 - 1}" y="{top + cell * j + cell / 2}" dy="0.32em" '
                f'text-anchor="middle" class="cellv">{"" if j == k else f"{v:+.2f}"}</text></g>'
            )
    parts.append("</svg>")
    return "".join(parts)
