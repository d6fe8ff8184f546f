"""`casi audit list` / `show` / expected failures of `run`, as the real command (a subprocess)
on a real SQLite database holding a stored audit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.reports.audit_json import build_report
from app.services.audit import _store
from evaluator.audit import AuditConfig, Games, audit

CASI = str(Path(sys.executable).with_name("casi"))


def _casi(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CASI, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture()
def stored(tmp_path: Path) -> tuple[dict[str, str], int, dict]:  # type: ignore[type-arg]
    url = f"sqlite:///{tmp_path / 'casi.db'}"
    upgrade_to_head(url)
    gen = torch.Generator().manual_seed(1)
    ref = torch.rand(24, 8, generator=gen, dtype=torch.float64)
    games = Games(ref + 0.1 * torch.randn(24, 8, generator=gen, dtype=torch.float64), ref,
                  torch.full((24,), 3), torch.arange(24) // 3)  # fmt: skip
    report = build_report(
        audit(games, AuditConfig(n_boot=50)), train={"name": "surrogate", "version": "s"},
        reference={"name": "replay", "version": "r"}, meta={"source": "sampled"},
    )  # fmt: skip
    engine = make_engine(url)
    out = _store(make_session_factory(engine), report, tmp_path / "audits", None)
    engine.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASI_")}
    env.update(DATABASE_URL=url, CASI_VAR_DIR=str(tmp_path / "var"), COLUMNS="200")
    return env, out.id, report


def test_list_and_show(stored) -> None:  # type: ignore[no-untyped-def]
    env, audit_id, report = stored
    listed = _casi("audit", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "surrogate" in listed.stdout and report["verdict"] in listed.stdout
    shown = _casi("audit", "show", str(audit_id), env=env)
    assert shown.returncode == 0, shown.stderr
    assert "marginal sign agreement by size" in shown.stdout
    assert f"verdict: {report['verdict']}" in shown.stdout
    as_json = _casi("audit", "show", str(audit_id), "--json", env=env)
    assert json.loads(as_json.stdout) == report


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("audit", "show", "999"), "no audit 999"),
        (
            ("audit", "run", "--evaluator", "replay"),
            "'replay' is both the reference and a training",
        ),
        (("audit", "run", "--evaluator", "cosine", "--split", "eval"), "unknown split 'eval'"),
        (("audit", "run", "--evaluator", "cosine", "--split", "dev"), "ships no DEV split"),
    ],
)
def test_expected_failures_are_one_error_line(stored, args: tuple[str, ...], message: str) -> None:  # type: ignore[no-untyped-def]
    env, _, _ = stored
    res = _casi(*args, env=env)
    out = res.stdout + res.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and message in errors[0], out
    assert "Traceback" not in out
