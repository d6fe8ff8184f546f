"""``casi keys create|list|revoke``: API keys (only their sha256 is stored)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from sqlalchemy.orm import Session, sessionmaker

from app.cli.common import fail, open_database
from app.limits import MAX_RECORD_ID
from app.progress import console
from app.services.keys import create_key, list_keys, revoke_key
from app.settings import get_settings

keys_app = typer.Typer(help="API keys for the REST API.", no_args_is_help=True)


def _factory() -> sessionmaker[Session]:
    return open_database(get_settings(), device=False)


@keys_app.command("create")
def create(
    scope: Annotated[
        str, typer.Option(help="user (rewrites, credits, reads) | admin (+ jobs, activation)")
    ] = "user",
    name: Annotated[str, typer.Option(help="A label to recognise the key by.")] = "default",
) -> None:
    """Create a key and print it ONCE (it cannot be shown again)."""
    if scope not in ("user", "admin"):
        fail(f"--scope must be 'user' or 'admin', got {scope!r}")
    info, plaintext = create_key(_factory(), name, scope)
    console.print(
        f"key {info.id} ({info.scope}, {info.name!r}) created; store it now, it is not shown again:",
        highlight=False,
    )
    typer.echo(plaintext)


@keys_app.command("list")
def list_cmd() -> None:
    """Keys with their id, prefix, scope and state (never the key)."""
    table = Table(title="API keys")
    for col in ("id", "name", "prefix", "scope", "created", "revoked"):
        table.add_column(col)
    for k in list_keys(_factory()):
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
    key_id: Annotated[
        int, typer.Argument(min=1, max=MAX_RECORD_ID, help="The key's id (see `casi keys list`).")
    ],
) -> None:
    """Revoke a key: it is refused (401) from the next request on."""
    try:
        info = revoke_key(_factory(), key_id)
    except LookupError as exc:
        fail(str(exc))
        return
    console.print(f"key {info.id} ({info.prefix}…) revoked")
