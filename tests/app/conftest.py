"""Real-database fixtures for app tests: SQLite (a tmp file) and PostgreSQL.

`db_url` is parametrized over both backends; `db_engine` is that database migrated to head
with Alembic; `db_session` is a Session on it (the test decides when to commit).

PostgreSQL URL, first match wins:
  1. CASI_TEST_PG_URL;
  2. DATABASE_URL when it is a postgresql URL;
  3. postgresql+psycopg://postgres@127.0.0.1:5432/test, then the same as user `root`
     (the CI machine and dev boxes use trust auth with either role).
If none is reachable, the PostgreSQL parameters FAIL when the CI environment variable is
set (a CI without its database must not go green), and are SKIPPED with the reason
otherwise (a laptop without PostgreSQL can still run the suite).

Isolation: each PostgreSQL test gets its own schema `t_<random>` (search_path set through
the connection's `options`, so tables and alembic_version live there) and drops it after,
so concurrent runs sharing the `test` database never collide.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import NoReturn

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from app.db.session import make_engine, make_session_factory, normalize_url, upgrade_to_head

DEFAULT_PG_URLS = (
    "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "postgresql+psycopg://root@127.0.0.1:5432/test",
)
PG_CONNECT_TIMEOUT_S = 3


def pg_candidate_urls() -> tuple[str, ...]:
    explicit = os.environ.get("CASI_TEST_PG_URL")
    if explicit:
        return (explicit,)
    database_url = os.environ.get("DATABASE_URL", "")
    if database_url.startswith(("postgresql", "postgres:")):
        return (database_url,)
    return DEFAULT_PG_URLS


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def postgres_unavailable(reason: str) -> NoReturn:
    """Fail under CI, skip elsewhere (see the module docstring)."""
    if _in_ci():
        pytest.fail(f"PostgreSQL is required when CI is set: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL unavailable ({reason}); set CASI_TEST_PG_URL to run these")


def _probe(url: str) -> str | None:
    """None when `url` accepts connections, else the error text."""
    engine = create_engine(
        normalize_url(url),
        poolclass=NullPool,
        connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S},
    )
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return None
    except Exception as exc:  # any driver/auth/network error means "not usable"
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    finally:
        engine.dispose()


@cache
def _first_reachable(urls: tuple[str, ...]) -> tuple[str | None, str]:
    errors = []
    for url in urls:
        error = _probe(url)
        if error is None:
            return url, ""
        errors.append(f"{normalize_url(url).render_as_string()}: {error}")
    return None, "; ".join(errors)


def require_postgres(urls: Sequence[str]) -> str:
    """The first reachable URL among `urls`, or fail/skip via `postgres_unavailable`."""
    url, errors = _first_reachable(tuple(urls))
    if url is None:
        postgres_unavailable(errors)
    return url


@pytest.fixture
def postgres_gate() -> Callable[[Sequence[str]], str]:
    """`require_postgres` itself, so its fail-in-CI / skip-elsewhere rule can be tested."""
    return require_postgres


@pytest.fixture
def pg_schema_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh, empty schema (dropped afterwards)."""
    admin_url = normalize_url(require_postgres(pg_candidate_urls()))
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        url = admin_url.update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgresql", marks=pytest.mark.integration),
    ]
)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database of each backend (not yet migrated)."""
    if request.param == "sqlite":
        return f"sqlite:///{(tmp_path / 'casi.db').as_posix()}"
    url: str = request.getfixturevalue("pg_schema_url")
    return url


@pytest.fixture
def db_engine(db_url: str) -> Iterator[Engine]:
    """`db_url` migrated to head with Alembic (the schema production gets)."""
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def db_session(db_engine: Engine) -> Iterator[Session]:
    session = make_session_factory(db_engine)()
    yield session
    session.rollback()
    session.close()


@pytest.fixture
def cli_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty var folder for CLI tests (embedded defaults: no DATABASE_URL, no REDIS_URL)."""
    from app.settings import get_settings

    var = tmp_path / "var"
    for name in ("DATABASE_URL", "REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CASI_VAR_DIR", str(var))
    get_settings.cache_clear()
    yield var
    get_settings.cache_clear()
