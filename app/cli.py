"""The ``casi`` command line (typer + rich). Each command is a thin composition root."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from app.progress import console, index_progress
from app.settings import get_settings
from evaluator.corpus import DatasetError

app = typer.Typer(help="CASI: per-action credit assignment for agentic retrieval.", no_args_is_help=True)
index_app = typer.Typer(help="Build and inspect the FAISS index.", no_args_is_help=True)
db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)
app.add_typer(index_app, name="index")
app.add_typer(db_app, name="db")

DatasetOpt = Annotated[Path | None, typer.Option("--dataset", help="BEIR-style folder (default data/scifact).")]
MaxDocsOpt = Annotated[
    int | None,
    typer.Option("--max-docs", min=1, help="Slice: first N documents + every judged document."),
]


def fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code=2)


@index_app.command("build")
def index_build(dataset: DatasetOpt = None, max_docs: MaxDocsOpt = None) -> None:
    """Embed the corpus and save a versioned FAISS index under var/ (reused when unchanged)."""
    from app.runtime import build_retrieval

    settings = get_settings()
    t0 = time.perf_counter()
    try:
        r = build_retrieval(settings, dataset_path=dataset, max_docs=max_docs, progress_factory=index_progress)
    except DatasetError as exc:
        fail(str(exc))
        return
    verb = "built" if r.built_now else "reused"
    console.print(
        f"index [bold]{r.index.version}[/] {verb}: {len(r.index)} documents, "
        f"embedder {r.embedder.version}, {time.perf_counter() - t0:.1f}s → "
        f"{settings.var_dir / 'index' / r.index.version}"
    )


@index_app.command("eval")
def index_eval(
    dataset: DatasetOpt = None,
    max_docs: MaxDocsOpt = None,
    split: Annotated[str, typer.Option(help="qrels split to evaluate")] = "test",
    k: Annotated[int, typer.Option(min=1)] = 10,
) -> None:
    """nDCG@k / recall@k of the plain query (no rewrites) — the retrieval sanity baseline."""
    from app.runtime import build_retrieval
    from evaluator.retrieval_eval import evaluate_queries

    settings = get_settings()
    try:
        r = build_retrieval(settings, dataset_path=dataset, max_docs=max_docs, progress_factory=index_progress)
    except DatasetError as exc:
        fail(str(exc))
        return
    res = evaluate_queries(r.dataset, r.embedder, r.index, split, k)
    table = Table(title=f"{split} split, {res['n_queries']} queries, {len(r.index)} docs")
    for name in ("ndcg", "recall"):
        table.add_column(f"{name}@{k}")
    table.add_row(f"{res['ndcg']:.4f}", f"{res['recall']:.4f}")
    console.print(table)


def _register_commands() -> None:
    from app.cli_credit import credit
    from app.cli_evaluator import evaluator_app
    from app.cli_step import step

    app.command("credit")(credit)
    app.add_typer(evaluator_app, name="evaluator")
    from app.cli_policy import policy_app, rewrite

    app.command("rewrite")(rewrite)
    app.add_typer(policy_app, name="policy")
    app.command("step")(step)


_register_commands()


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply Alembic migrations to DATABASE_URL (default SQLite under var/)."""
    from app.db.session import upgrade_to_head

    settings = get_settings()
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.sqlalchemy_url)
    console.print(f"database at head: {settings.sqlalchemy_url}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
