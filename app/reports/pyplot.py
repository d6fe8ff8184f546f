"""THE matplotlib entry point of every CASI figure: :func:`pyplot`, on the Agg backend (files and
inline SVG, no display)."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def pyplot() -> Any:
    """``matplotlib.pyplot`` on Agg, imported on first use (lazy: importing it costs ~0.5 s, which
    every `casi` start-up would pay through the modules that draw)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
