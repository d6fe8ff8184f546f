"""Every ``error:`` line goes to stderr, never to stdout: the README's
``export KEY=$(casi keys create --scope admin --name me | tail -1)`` stored the error text as
the key when the command failed, and ``2>/dev/null`` did not hide errors. The real ``casi``
command in a subprocess, its two streams read apart: ``fail`` (the commands' own refusals),
the boundary's known failure (a bad DATABASE_URL) and its unexpected failure (a bug)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hardening_support import CASI, ROOT, casi_env

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("DATABASE_URL")),
    reason="it runs casi on the embedded defaults whatever DATABASE_URL says (casi_env drops it): "
    "the pass without DATABASE_URL (.ci/run's second) runs it",
)

BOOM = """
import sys, typer
from app.cli.common import run_cli
app = typer.Typer()
@app.command()
def boom() -> None:
    print("stdout before the failure")
    raise RuntimeError("kaput")
sys.argv = ["casi"]
run_cli(app)
"""


def _run(argv: list[str], var: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=casi_env(var, **env), cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_a_known_failure_is_on_stderr_only(tmp_path: Path) -> None:
    done = _run([CASI, "keys", "create", "--scope", "admin", "--name", "me"], tmp_path / "var",
                DATABASE_URL="bogus://x")  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "", done.stdout  # `$(… | tail -1)` captures nothing
    (line,) = _errors(done.stderr)
    assert "DATABASE_URL" in line, line


def test_a_refusal_of_a_command_is_on_stderr_only(tmp_path: Path) -> None:
    done = _run([CASI, "experiment", "credit", "--seeds", "3-1"], tmp_path / "var")
    assert done.returncode == 2, done.stdout + done.stderr
    assert _errors(done.stdout) == [], done.stdout
    (line,) = _errors(done.stderr)
    assert "--seeds" in line and "'3-1'" in line, line


def test_an_unexpected_failure_is_on_stderr_only(tmp_path: Path) -> None:
    done = _run([sys.executable, "-c", BOOM], tmp_path / "var")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout == "stdout before the failure\n", done.stdout
    (line,) = _errors(done.stderr)
    assert "unexpected failure, RuntimeError: kaput" in line, line
