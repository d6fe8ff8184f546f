"""What every ``casi`` command shares: the one ``fail`` and the common options."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer

from app.progress import console

DatasetOpt = Annotated[
    Path | None, typer.Option("--dataset", help="BEIR-style folder (default data/scifact).")
]
MaxDocsOpt = Annotated[
    int | None,
    typer.Option("--max-docs", min=1, help="Slice: first N documents + every judged document."),
]
PolicyOpt = Annotated[
    str | None,
    typer.Option(
        "--policy",
        help="Policy: a registered version hash, a local HF model folder, or nothing for the default SmolLM2.",
    ),
]


def fail(message: str) -> NoReturn:
    """Print one ``error:`` line and exit with status 2 (the CLI's expected-failure path)."""
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    raise typer.Exit(code=2)
