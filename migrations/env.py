"""Alembic environment for CASI: which database, which metadata, how to compare.

URL resolution: `sqlalchemy.url` set by the caller (`app.db.session.upgrade_to_head`), else
the DATABASE_URL environment variable, else `sqlite:///var/casi.db`.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import pool

from app.db.models import Base
from app.db.session import make_engine, normalize_url

DEFAULT_URL = "sqlite:///var/casi.db"

config = context.config
target_metadata = Base.metadata

# Programmatic callers (tests, the app) keep their own logging setup.
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def database_url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("DATABASE_URL")
    return normalize_url(url or DEFAULT_URL).render_as_string(hide_password=False)


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade head --sql`) without connecting."""
    url = database_url()
    context.configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=normalize_url(url).get_backend_name() == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(database_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            if connection.dialect.name == "sqlite":
                # batch mode rebuilds a table and DROPs the old one; with foreign keys on (every
                # CASI connection turns them on) that DROP is a DELETE whose ON DELETE actions
                # emptied credit_records and step_metrics. Off for the migration's connection
                # (a no-op inside a transaction, so before it begins); sound links stay sound.
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                compare_type=True,
                # SQLite cannot ALTER most things: batch mode recreates the table instead.
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
