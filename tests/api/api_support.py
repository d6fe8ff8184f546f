"""Helpers of the API tests: a real `casi serve` subprocess, keys, a private redis-server."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = float(os.environ.get("CASI_TEST_START_S", "180"))
"""How long a server may take to start (imports, index, policy); CASI_TEST_START_S raises it on
a machine whose cores other work keeps busy (there a start has taken over 3 minutes)."""


@functools.cache
def app_conftest():  # type: ignore[no-untyped-def]
    """tests/app/conftest.py as a module: its PostgreSQL helpers and schema fixture, reused."""
    spec = importlib.util.spec_from_file_location(
        "casi_app_conftest", ROOT / "tests/app/conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiServer:
    """`python -m app.cli serve` with ``env``; logs to ``log_path``."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env, self.log_path = env, log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ApiServer:
        argv = [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port)]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            if self.started():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"server not up in {START_TIMEOUT_S}s: {self.log_path.read_text()[-3000:]}"
        )

    def started(self) -> bool:
        """Whether it answers and its start-up work has finished: it listens at once and
        `/readyz` names ``startup`` while that work runs (the database may still be down)."""
        try:
            ready = httpx.get(self.url + "/readyz", timeout=5)
        except httpx.HTTPError:
            return False
        try:
            return "startup" not in ready.json().get("down", [])
        except ValueError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def server_env(
    *, var: Path, dataset: Path, database_url: str, redis_url: str, policy: Path, **extra: str
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASI_")}
    env.update(
        CASI_VAR_DIR=str(var), CASI_DATASET=str(dataset), DATABASE_URL=database_url,
        REDIS_URL=redis_url, CASI_API_POLICY=str(policy), CASI_THREADS="2",
        CASI_API_MAX_WAIT_MS="20", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false", CASI_API_MAX_NEW_TOKENS="24",
    )  # fmt: skip
    env.update(extra)
    return env


def make_key(database_url: str, scope: str, name: str = "test") -> str:
    """A new API key stored in ``database_url`` (the server's database)."""
    from app.db.session import make_engine, make_session_factory
    from app.services.keys import create_key

    engine = make_engine(database_url)
    try:
        return create_key(make_session_factory(engine), name, scope)[1]
    finally:
        engine.dispose()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class RedisServer:
    """A private `redis-server` on a free port (no persistence), to be killed mid-test."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class TcpProxy:
    """A loopback TCP forwarder to ``target``; `stop` makes the target unreachable through it
    (listener and every connection closed), `start` brings it back on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.port = target, free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        with self._lock:
            socks, self._conns = [s for s in [self._listener, *self._conns] if s], []
            self._listener = None
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
