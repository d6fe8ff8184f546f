"""Engines, sessions and programmatic Alembic for one database URL.

Read `make_engine` and `session_scope` first. Nothing here runs at import time: the CLI or
the API lifespan builds the engine from settings and injects it. `upgrade_to_head(url)`
applies `migrations/` to any URL (SQLite file or PostgreSQL) without the alembic CLI.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

REPO_ROOT = Path(__file__).resolve().parents[2]
ALEMBIC_INI = REPO_ROOT / "alembic.ini"  # optional (logging only); absent in a wheel install
MIGRATIONS_DIR = Path(__file__).resolve().parent / "_migrations"
"""Package data: in the source tree a symlink to migrations/, in a wheel the files themselves."""


def normalize_url(url: str | URL) -> URL:
    """Parse `url`; plain `postgresql://` means psycopg 3 (the driver CASI installs)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An engine for `url`; extra kwargs go to `create_engine`.

    SQLite: the file's folder is created, foreign keys are enforced (off by default in
    SQLite) and the connection may be used from FastAPI's worker threads.
    PostgreSQL: connections are pinged before use, so a restarted server is survived.
    """
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {}).setdefault("check_same_thread", False)
        engine = create_engine(parsed, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **kwargs)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (services return them)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """The one transaction of a service call: commit on success, roll back on error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def alembic_config(url: str | URL) -> Config:
    """An Alembic Config for this repo's migrations, pointed at `url`."""
    config = Config(str(ALEMBIC_INI) if ALEMBIC_INI.is_file() else None)
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    rendered = normalize_url(url).render_as_string(hide_password=False)
    # ConfigParser interpolates '%': escape it (URL-quoted passwords, options=-c...%3D...).
    config.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    config.attributes["configure_logger"] = False  # keep the caller's logging as it is
    return config


def upgrade_to_head(url: str | URL) -> None:
    """Apply every migration to the database at `url` (idempotent)."""
    command.upgrade(alembic_config(url), "head")


def downgrade_to_base(url: str | URL) -> None:
    """Revert every migration (drops all CASI tables). Tests and `casi` admin use only."""
    command.downgrade(alembic_config(url), "base")


def is_at_head(engine: Engine) -> bool:
    """Whether the database's Alembic revision is the newest one (readiness checks)."""
    head = ScriptDirectory.from_config(alembic_config(engine.url)).get_current_head()
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision() == head
