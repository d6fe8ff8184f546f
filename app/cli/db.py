"""``casi db upgrade``: apply the Alembic migrations."""

from __future__ import annotations

import typer
from sqlalchemy.engine import make_url

from app.progress import console
from app.runtime import preflight
from app.settings import get_settings

db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply Alembic migrations to DATABASE_URL (default SQLite under var/)."""
    settings = get_settings()
    preflight(
        settings, database=True, device=False
    )  # checks the database in one line, then migrates
    shown = make_url(settings.sqlalchemy_url).render_as_string(hide_password=True)
    console.print(f"database at head: {shown}")
