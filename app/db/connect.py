"""THE place a process builds its database from settings: :func:`connect` returns the engine and
the session factory of ``DATABASE_URL`` (the CLI, the API lifespan and the training services all
call it); with ``migrate=True`` the database is first checked (:func:`migrate_to_head`: one clear error
when CASI cannot use it) and upgraded to the newest migration."""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.db.session import check_database, make_engine, make_session_factory, upgrade_to_head
from app.settings import Settings


@dataclass(frozen=True)
class Database:
    """One engine and its session factory; ``with connect(...) as db:`` disposes the engine."""

    engine: Engine
    factory: sessionmaker[Session]

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Database:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def migrate_to_head(settings: Settings) -> None:
    """Check that the database is one CASI can use (fails fast, in one line), then upgrade it
    to head (idempotent, under a file lock)."""
    check_database(settings.sqlalchemy_url)
    upgrade_to_head(settings.sqlalchemy_url)


def connect(settings: Settings, *, migrate: bool = False) -> Database:
    """The engine and session factory of ``settings.sqlalchemy_url`` (migrated first when
    ``migrate``)."""
    if migrate:
        migrate_to_head(settings)
    engine = make_engine(settings.sqlalchemy_url)
    return Database(engine, make_session_factory(engine))
