"""Progress outside a terminal (nohup logs, make, CI): plain lines with count, info and ETA."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

import app.progress as progress
from app.progress import clock, progress_bar, progress_line


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, force_terminal=False, width=150))
    return out


def test_clock_and_line() -> None:
    assert clock(0) == "0:00" and clock(65.4) == "1:05" and clock(3725) == "1:02:05"
    line = progress_line("Warm start (SFT steps)", 15, 60, 30.0, "loss 1.234")
    assert line == "Warm start (SFT steps) 15/60 loss 1.234, elapsed 0:30, ETA 1:30"
    assert progress_line("x", 3, None, 2.0, "") == "x 3, elapsed 0:02"


def test_lines_with_info_outside_a_terminal(log: io.StringIO) -> None:
    with progress_bar("Warm start (SFT steps)", 3, log_every_s=0.0) as advance:
        for loss in (2.5, 1.75, 1.25):
            advance(1, f"loss {loss:.3f}")
    lines = log.getvalue().splitlines()
    assert [ln.split(",")[0] for ln in lines] == [
        "Warm start (SFT steps) 1/3 loss 2.500",
        "Warm start (SFT steps) 2/3 loss 1.750",
        "Warm start (SFT steps) 3/3 loss 1.250",
    ]
    assert "ETA" in lines[0] and "elapsed" in lines[-1]


def test_rate_limited_but_the_end_is_always_printed(log: io.StringIO) -> None:
    with progress_bar("Embedding corpus", 100, log_every_s=3600.0) as advance:
        for _ in range(100):
            advance(1)
    assert log.getvalue().splitlines() == [log.getvalue().splitlines()[0]]
    assert log.getvalue().startswith("Embedding corpus 100/100, elapsed")
    log.truncate(0), log.seek(0)
    with progress_bar("Sampling", None, log_every_s=3600.0) as advance:  # no total: end line
        advance(7)
    assert log.getvalue().startswith("Sampling 7, elapsed")
