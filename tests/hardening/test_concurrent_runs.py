"""Concurrent runs are safe: two `casi index build` on an empty var dir build once (the second
waits for the lock and reuses the index), two `casi db upgrade` migrate once, and two identical
`casi policy warmstart` runs write one checkpoint and register one version (idempotent).
Real processes of the real command."""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

import pytest
from hardening_support import start_casi


def _both(procs: list[subprocess.Popen[str]], timeout: float = 300) -> list[str]:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
        assert "error:" not in out and "Traceback" not in out, out
    return outs


@pytest.mark.integration
def test_two_index_builds_on_an_empty_var_dir_build_once(tmp_path: Path, tiny_beir: Path) -> None:
    var = tmp_path / "var"
    outs = _both([start_casi(["index", "build"], var, CASI_DATASET=str(tiny_beir)) for _ in "ab"])
    verbs = sorted(next(w for w in ("built", "reused") if f" {w}: " in out) for out in outs)
    assert verbs == ["built", "reused"], outs
    folders = [p for p in (var / "index").iterdir() if p.is_dir()]
    assert len(folders) == 1 and not [p for p in folders if p.name.startswith(".")]


@pytest.mark.integration
def test_two_migrations_at_once(tmp_path: Path) -> None:
    var = tmp_path / "var"
    _both([start_casi(["db", "upgrade"], var) for _ in "ab"], timeout=120)
    with sqlite3.connect(var / "casi.db") as conn:
        assert len(conn.execute("SELECT version_num FROM alembic_version").fetchall()) == 1


@pytest.mark.integration
def test_the_same_warm_start_twice_registers_once(
    tmp_path: Path, tiny_beir: Path, tiny_checkpoint: Path
) -> None:
    """Seen: re-running `casi policy warmstart` failed with a UNIQUE-constraint error; later, two
    identical runs at once both trained. Now the second waits for the first and reuses it."""
    var = tmp_path / "var"
    args = ["policy", "warmstart", "--policy", str(tiny_checkpoint), "--steps", "1"]
    args += ["--batch-size", "2", "--queries", "2"]
    outs = _both([start_casi(args, var, CASI_DATASET=str(tiny_beir)) for _ in "ab"])
    assert sum("warm start reused" in out for out in outs) == 1, outs
    assert sum("; checkpoint " in out and "saved" in out for out in outs) == 1, outs
    assert not any("already registered" in out for out in outs), outs
    with sqlite3.connect(var / "casi.db") as conn:
        kinds = sorted(k for (k,) in conn.execute("SELECT kind FROM policy_versions"))
    assert kinds == ["base", "warmstart"]
    assert len(list((var / "models").glob("warmstart-*"))) == 1
