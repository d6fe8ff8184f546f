"""``casi keys create|list|revoke``: API keys (only their sha256 is stored)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from sqlalchemy.orm import Session, sessionmaker

from app.progress import console
from app.settings import get_settings

keys_app = typer.Typer(help="API keys for the REST API.", no_args_is_help=True)


def _factory() -> sessionmaker[Session]:
    from app.db.session import make_engine, make_session_factory, upgrade_to_head

    settings = get_settings()
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.sqlalchemy_url)
    return make_session_factory(make_engine(settings.sqlalchemy_url))


@keys_app.command("create")
def create(
    scope: Annotated[
        str, typer.Option(help="user (rewrites, credits, reads) | admin (+ jobs, activation)")
    ] = "user",
    name: Annotated[str, typer.Option(help="A label to recognise the key by.")] = "default",
) -> None:
    """Create a key and print it ONCE (it cannot be shown again)."""
    from app.cli.common import fail
    from app.services.keys import create_key

    if scope not in ("user", "admin"):
        fail(f"--scope must be 'user' or 'admin', got {scope!r}")
    info, plaintext = create_key(_factory(), name, scope)
    console.print(
        f"key {info.id} ({info.scope}, {info.name!r}) created; store it now, it is not shown again:",
        highlight=False,
    )
    typer.echo(plaintext)


@keys_app.command("list")
def list_keys() -> None:
    """Keys with their id, prefix, scope and state (never the key)."""
    from app.services.keys import list_keys as list_all

    table = Table(title="API keys")
    for col in ("id", "name", "prefix", "scope", "created", "revoked"):
        table.add_column(col)
    for k in list_all(_factory()):
        revoked = k.revoked_at.strftime("%Y-%m-%d %H:%M") if k.revoked_at else "-"
        table.add_row(
            str(k.id),
            k.name,
            k.prefix + "…",
            k.scope,
            k.created_at.strftime("%Y-%m-%d %H:%M"),
            revoked,
        )
    console.print(table)


@keys_app.command("revoke")
def revoke(
    key_id: Annotated[int, typer.Argument(help="The key's id (see `casi keys list`).")],
) -> None:
    """Revoke a key: it is refused (401) from the next request on."""
    from app.cli.common import fail
    from app.services.keys import revoke_key

    try:
        info = revoke_key(_factory(), key_id)
    except LookupError as exc:
        fail(str(exc))
        return
    console.print(f"key {info.id} ({info.prefix}…) revoked")
