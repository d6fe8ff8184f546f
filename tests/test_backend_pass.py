"""CI's second pass (tests/backend_pass.py): it skips only tests the first pass ran, passed, and
ran without reaching a service; everything else runs again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SUITE = """
import os, subprocess, sys
import pytest
from sqlalchemy import create_engine, text


def test_no_backend():
    assert 1 + 1 == 2


def test_sqlite(tmp_path):
    with create_engine(f"sqlite:///{tmp_path / 'x.db'}").connect() as conn:
        assert conn.execute(text("select 1")).scalar() == 1


def test_redis_service():
    import redis
    redis.Redis.from_url(os.environ["SERVICE_REDIS"]).ping()


def test_child_with_service_env():
    env = {**os.environ, "DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none"}
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)


def test_child_on_sqlite(tmp_path):
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}"}
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)


def test_child_without_service_env():
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)


@pytest.mark.skip(reason="skipped in the first pass")
def test_skipped():
    pass


def test_fails():
    assert os.environ.get("SECOND_PASS") == "1"
"""

SERVER = """
import os, subprocess, sys
import pytest


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
    yield proc
    proc.kill()
    proc.wait()


def test_served_first(server):
    assert server.poll() is None


def test_served_second(server):
    assert server.poll() is None
"""


def _pytest(folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    base["PYTHONPATH"] = os.pathsep.join([str(TESTS), base.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "backend_pass", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", str(folder)],
        cwd=folder, env={**base, **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_second_pass_runs_what_a_backend_can_change(tmp_path: Path) -> None:
    service = os.environ.get("REDIS_URL")
    if not service:
        pytest.skip("needs the Redis service (REDIS_URL): the services pass runs it")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_suite.py").write_text(SUITE)
    (suite / "test_server.py").write_text(SERVER)  # runs first; its server ends with it
    listing = tmp_path / "same.txt"

    first = _pytest(suite, CASI_BACKEND_RECORD=str(listing), SERVICE_REDIS=service)
    assert "1 failed, 8 passed, 1 skipped" in first.stdout, first.stdout + first.stderr
    independent = sorted(line.split("::")[1] for line in listing.read_text().split())
    assert independent == [
        "test_child_on_sqlite",
        "test_child_without_service_env",
        "test_no_backend",
        "test_sqlite",
    ]

    second = _pytest(suite, CASI_BACKEND_SKIP=str(listing), SERVICE_REDIS=service,
                     SECOND_PASS="1")  # fmt: skip
    assert "5 passed, 1 skipped, 4 deselected" in second.stdout, second.stdout + second.stderr

    missing = _pytest(suite, CASI_BACKEND_SKIP=str(tmp_path / "none.txt"),
                      SERVICE_REDIS=service, SECOND_PASS="1")  # fmt: skip
    assert "9 passed, 1 skipped" in missing.stdout, missing.stdout + missing.stderr
