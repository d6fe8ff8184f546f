"""``casi index build|eval``: the versioned FAISS index and its plain-query baseline."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import DatasetOpt, MaxDocsOpt, fail
from app.progress import console, index_progress
from app.settings import get_settings

index_app = typer.Typer(help="Build and inspect the FAISS index.", no_args_is_help=True)


@index_app.command("build")
def index_build(dataset: DatasetOpt = None, max_docs: MaxDocsOpt = None) -> None:
    """Embed the corpus and save a versioned FAISS index under var/ (reused when unchanged).

    The slice built here becomes the default of later commands (no --max-docs needed)."""
    from app.runtime import build_retrieval, remember_default_index

    settings = get_settings()
    t0 = time.perf_counter()
    r = build_retrieval(
        settings,
        dataset_path=dataset,
        max_docs=max_docs,
        progress_factory=index_progress,
        use_default_slice=False,
    )
    remember_default_index(settings, r.dataset.path, max_docs or settings.max_docs)
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
    qrels = (dataset or settings.dataset) / "qrels"
    known = sorted(p.stem for p in qrels.glob("*.tsv"))
    if split not in known:  # before the (possibly long) index build
        fail(f"unknown split {split!r} ({qrels}) — use one of: {', '.join(known) or 'none found'}")
    r = build_retrieval(
        settings, dataset_path=dataset, max_docs=max_docs, progress_factory=index_progress
    )
    res = evaluate_queries(r.dataset, r.embedder, r.index, split, k)
    table = Table(title=f"{split} split, {res['n_queries']} queries, {len(r.index)} docs")
    for name in ("ndcg", "recall"):
        table.add_column(f"{name}@{k}")
    table.add_row(f"{res['ndcg']:.4f}", f"{res['recall']:.4f}")
    console.print(table)
