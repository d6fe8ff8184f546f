"""How the dashboard colours a credit (φ, singleton, leave-one-out, shaped x, A + λx, pairwise
interaction): its sign, and its size relative to the sample's largest. Read :func:`credit_level`.

A value below :data:`NEUTRAL_BELOW` is neutral: it prints as ±0.000 and is float noise, not
credit. The scale the shades are relative to is never below it either (:func:`colour_scale`), so
a sample whose values are all noise is grey, not darkest green and red (issue 27).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

NEUTRAL_BELOW = 5e-4
"""|value| below this is neutral and never sets the scale: half a unit of the third decimal,
the precision credits print with, so nothing that reads ±0.000 is coloured. Float noise is far
below it (≈1e-16 from Σ over 2^m coalitions and centring, ≈1e-8 once divided by a group scale
that is only its ε)."""
LEVELS = 4  # shades per sign: the CSS classes c-pos1..4 and c-neg1..4


def _number(v: Any) -> float | None:
    """``v`` as a finite float, or None (missing, not a number, NaN, ±inf)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def colour_scale(*lists: Iterable[Any] | None) -> float:
    """What the shades are relative to: the largest |value| in ``lists``, but never less than
    NEUTRAL_BELOW (a sample of noise is not normalised by its noise)."""
    sizes = [abs(x) for xs in lists for x in map(_number, xs or ()) if x is not None]
    return max([NEUTRAL_BELOW, *sizes])


def credit_level(v: Any, scale: float) -> int:
    """0 when ``v`` is neutral (|v| < NEUTRAL_BELOW, or no number), else ±1..±LEVELS: the sign
    of ``v`` and its size as a share of ``scale`` (floored at NEUTRAL_BELOW), a quarter a level."""
    x = _number(v)
    if x is None or abs(x) < NEUTRAL_BELOW:
        return 0
    share = abs(x) / max(scale, NEUTRAL_BELOW)
    level = 1 + min(LEVELS - 1, int(LEVELS * share - 1e-9))  # share 1 is the top level, not 5
    return level if x > 0 else -level


def credit_class(v: Any, scale: float) -> str:
    """The CSS class of a credit cell: ``c-zero`` (neutral) or ``c-pos1..4`` / ``c-neg1..4``."""
    level = credit_level(v, scale)
    return "c-zero" if level == 0 else f"c-{'pos' if level > 0 else 'neg'}{abs(level)}"
