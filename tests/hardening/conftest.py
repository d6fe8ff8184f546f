"""Fixtures of the hardening suite (issue 13); the helpers live in ``hardening_support``.
Nothing is mocked: real files, the real ``casi`` command, real Redis and databases.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hardening_support import CasiRun, RedisServer, run_casi, write_tiny_beir


@pytest.fixture(scope="session")
def tiny_beir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_beir(tmp_path_factory.mktemp("tiny-beir"))


@pytest.fixture(scope="session")
def casi() -> Callable[..., CasiRun]:
    return run_casi


@pytest.fixture
def redis_server() -> Iterator[Callable[..., RedisServer]]:
    started: list[RedisServer] = []

    def start(*config: str) -> RedisServer:
        server = RedisServer(*config)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


PG_URLS = (
    "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "postgresql+psycopg://root@127.0.0.1:5432/test",
)


@pytest.fixture(scope="session")
def pg_url() -> str:
    """A reachable PostgreSQL URL (CASI_TEST_PG_URL first); fail under CI, else skip."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    from app.db.session import normalize_url

    candidates = [os.environ["CASI_TEST_PG_URL"]] if os.environ.get("CASI_TEST_PG_URL") else []
    errors = []
    for url in [*candidates, *PG_URLS]:
        engine = create_engine(
            normalize_url(url), poolclass=NullPool, connect_args={"connect_timeout": 3}
        )
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return url
        except Exception as exc:  # any driver/auth/network error: try the next one
            errors.append(f"{type(exc).__name__}")
        finally:
            engine.dispose()
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"PostgreSQL is required when CI is set: {errors}", pytrace=False)
    pytest.skip(f"PostgreSQL unavailable ({errors})")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, smol_tokenizer) -> Path:  # type: ignore[no-untyped-def]
    """A tiny Llama saved with save_checkpoint (manifest included), never modified."""
    from policy.model import build_tiny_policy, save_checkpoint

    model = build_tiny_policy(smol_tokenizer, seed=0)
    return save_checkpoint(model, smol_tokenizer, tmp_path_factory.mktemp("ckpt") / "tiny")
