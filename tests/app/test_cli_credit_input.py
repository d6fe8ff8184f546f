"""Issue 51, item 11: `casi credit` refuses an empty or blank rewrite — one ``error:`` line
naming which, exit 2 — before anything loads (it took one as an action before, credited 0 as a
null player). The real command in a subprocess, on an empty var folder: nothing is built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASI = str(Path(sys.executable).with_name("casi"))


@pytest.mark.parametrize(
    ("rewrites", "which"),
    [
        (["statins", ""], "rewrite 2 of 2 is blank"),
        (["  ", "statins", "\t"], "rewrites 1, 3 of 3 are blank"),
    ],
    ids=["empty", "blank"],
)
def test_a_blank_rewrite_is_one_error_line(tmp_path: Path, rewrites: list[str], which: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASI_")}
    env.update(CASI_VAR_DIR=str(tmp_path / "var"), COLUMNS="200")
    done = subprocess.run(
        [CASI, "credit", "--query-id", "0", "--rewrites", *rewrites],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {which} (--rewrites) — give each rewrite some text, or leave the blank one out"
    ]
    assert "Traceback" not in done.stdout and not (tmp_path / "var").exists()  # nothing built
