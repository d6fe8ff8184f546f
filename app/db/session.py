"""Engines, sessions and programmatic Alembic for one database URL.

Read `make_engine` and `session_scope` first. Nothing here runs at import time: the CLI or
the API lifespan builds the engine from settings and injects it. `upgrade_to_head(url)`
applies `migrations/` to any URL (SQLite file or PostgreSQL) without the alembic CLI, under a
file lock; `check_database(url)` fails fast, in one line, on a database CASI cannot use.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
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
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.exc import DatabaseError as SQLAlchemyDatabaseError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from app.errors import DatabaseProblem
from evaluator.locks import build_lock

REPO_ROOT = Path(__file__).resolve().parents[2]
ALEMBIC_INI = REPO_ROOT / "alembic.ini"  # optional (logging only); absent in a wheel install
MIGRATIONS_DIR = Path(__file__).resolve().parent / "_migrations"
"""Package data: in the source tree a symlink to migrations/, in a wheel the files themselves."""


SQLITE_BUSY_S = 30.0
"""How long an SQLite connection waits for another process's write lock (Python's default is
5 s: a second CLI's start-up check failed while a first one migrated on 2 loaded cores)."""


def normalize_url(url: str | URL) -> URL:
    """Parse `url`; plain `postgresql://` means psycopg 3 (the driver CASI installs)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An engine for `url`; extra kwargs go to `create_engine`.

    SQLite: the file's folder is created, the file is private (mode 0600: it holds API key
    hashes), foreign keys are enforced (off by default in SQLite) and the connection may be
    used from FastAPI's worker threads, and a connection waits up to ``SQLITE_BUSY_S`` for
    another process's write (a migration in progress) before "database is locked".
    PostgreSQL: connections are pinged before use, so a restarted server is survived.
    """
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            _private_file(Path(parsed.database))
        connect_args = kwargs.setdefault("connect_args", {})
        connect_args.setdefault("check_same_thread", False)
        connect_args.setdefault("timeout", SQLITE_BUSY_S)
        engine = create_engine(parsed, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **kwargs)


def _private_file(path: Path) -> None:
    """Create ``path`` owner-only (0600), or make an existing one so; best effort."""
    try:
        if path.exists() and not path.is_file():
            return  # a folder where the file should be: check_database says so
        path.touch(mode=0o600, exist_ok=True)
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
    except OSError:
        pass  # a read-only or foreign file: SQLite reports what matters when it opens it


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    """Foreign keys on; write-ahead log with ``synchronous=NORMAL``: a commit appends to the
    log without an fsync (the log is synced at checkpoints), so a committed transaction
    survives a crash of the process, not a power cut in the last moments — the standard
    setting for an SQLite server, and readers never block the writer. A commit took 2.4 ms
    (an fsync each) in DELETE-journal mode on this machine."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    if dbapi_connection.execute("PRAGMA journal_mode").fetchone()[0].lower() != "memory":
        cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
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


def _migration_lock_target(url: URL) -> Path:
    """What the migration lock sits next to: the SQLite file, else a per-URL temp file."""
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        return Path(url.database)
    key = hashlib.sha256(url.render_as_string(hide_password=False).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"casi-migrate-{key}"


def upgrade_to_head(url: str | URL) -> None:
    """Apply every migration to the database at `url` (idempotent).

    Holds a file lock, so concurrent CLI runs on one machine migrate one after the other.
    """
    with build_lock(_migration_lock_target(normalize_url(url)), "database migrations"):
        command.upgrade(alembic_config(url), "head")


DB_FIX = "fix DATABASE_URL, or unset it for the default SQLite file under CASI_VAR_DIR"


def check_database(url: str | URL) -> None:
    """Fail fast, in one line, when `url` cannot be CASI's database: unparsable, unreachable,
    a directory or not a database file, or at an Alembic revision this CASI does not know.

    Cheap (one connection, SQLite's quick_check); run it before any expensive work.
    """
    try:
        parsed = normalize_url(url)
    except (ArgumentError, ValueError) as exc:
        raise DatabaseProblem(f"not a database URL ({exc})", "DATABASE_URL", DB_FIX) from None
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite":
        _check_sqlite_path(parsed, shown)
    try:
        engine = make_engine(parsed, **_probe_kwargs(parsed))
    except (ArgumentError, ImportError) as exc:
        raise DatabaseProblem(f"unsupported database URL: {exc}", shown, DB_FIX) from None
    try:
        current = _read_heads(engine, parsed, shown)
    except OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise DatabaseProblem(
            f"cannot connect to the database: {reason}",
            shown,
            "start the database server, or fix DATABASE_URL",
        ) from None
    except SQLAlchemyDatabaseError as exc:
        raise _not_a_database(shown, exc) from None
    finally:
        engine.dispose()
    _check_revisions(parsed, shown, current)


def _read_heads(engine: Engine, parsed: URL, shown: str) -> tuple[str, ...]:
    """The database's Alembic heads (SQLite: after its quick_check). A fresh SQLite file that
    another process is creating or migrating answers "database is locked" at once, not after
    its busy timeout: wait for it, up to that timeout, as a write would."""
    deadline = time.monotonic() + SQLITE_BUSY_S
    while True:
        try:
            with engine.connect() as conn:
                if parsed.get_backend_name() == "sqlite":
                    _sqlite_quick_check(conn, shown)
                return tuple(MigrationContext.configure(conn).get_current_heads())
        except OperationalError as exc:
            locked = "database is locked" in str(exc.orig or exc)
            if not (parsed.get_backend_name() == "sqlite" and locked) or (
                time.monotonic() >= deadline
            ):
                raise
            time.sleep(0.1)


def _probe_kwargs(parsed: URL) -> dict[str, Any]:
    if parsed.get_backend_name() == "postgresql":
        return {"connect_args": {"connect_timeout": 5}, "poolclass": NullPool}
    return {"poolclass": NullPool}


def _check_sqlite_path(parsed: URL, shown: str) -> None:
    if not parsed.database or parsed.database == ":memory:":
        return
    path = Path(parsed.database)
    if path.is_dir():
        raise DatabaseProblem(
            "the SQLite database path is a folder",
            shown,
            "move the folder away or fix DATABASE_URL",
        )
    if path.parent.exists() and not path.parent.is_dir():
        raise DatabaseProblem("the SQLite file's folder is a regular file", shown, DB_FIX)


def _sqlite_quick_check(conn: Any, shown: str) -> None:
    row = conn.exec_driver_sql("PRAGMA quick_check").first()
    if row is None or row[0] != "ok":
        raise _not_a_database(shown, row[0] if row else "quick_check failed")


def _not_a_database(shown: str, detail: object) -> DatabaseProblem:
    reason = str(getattr(detail, "orig", None) or detail).strip().splitlines()[0]
    return DatabaseProblem(
        f"the database is damaged or not a database ({reason})",
        shown,
        "restore it from a backup, or move it away so CASI creates a fresh one",
    )


def _check_revisions(parsed: URL, shown: str, current: tuple[str, ...]) -> None:
    scripts = ScriptDirectory.from_config(alembic_config(parsed))
    known = {rev.revision for rev in scripts.walk_revisions()}
    unknown = [rev for rev in current if rev not in known]
    if unknown:
        raise DatabaseProblem(
            f"the database is at Alembic revision {unknown[0]!r}, which this CASI does not know",
            shown,
            "point DATABASE_URL at a CASI database of this version, or upgrade CASI",
        )


def downgrade_to_base(url: str | URL) -> None:
    """Revert every migration (drops all CASI tables). Tests and `casi` admin use only."""
    command.downgrade(alembic_config(url), "base")


def is_at_head(engine: Engine) -> bool:
    """Whether the database's Alembic revision is the newest one (readiness checks)."""
    head = ScriptDirectory.from_config(alembic_config(engine.url)).get_current_head()
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision() == head
