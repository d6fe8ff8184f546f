"""``casi db upgrade``: apply the Alembic migrations."""

from __future__ import annotations

import typer

from app.progress import console
from app.settings import get_settings

db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply Alembic migrations to DATABASE_URL (default SQLite under var/)."""
    from app.db.session import upgrade_to_head

    settings = get_settings()
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.sqlalchemy_url)
    console.print(f"database at head: {settings.sqlalchemy_url}")
