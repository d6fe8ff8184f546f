"""``casi index build|eval``: the versioned index (dense FAISS or BM25) and its plain-query baseline."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import DatasetOpt, MaxDocsOpt, fail
from app.progress import console, index_progress
from app.runtime import build_retrieval, remember_default_index
from app.settings import get_settings
from evaluator.corpus import available_splits
from evaluator.retrieval_eval import evaluate_retriever
from evaluator.retrievers import registered_retrievers

index_app = typer.Typer(help="Build and inspect the retrieval index.", no_args_is_help=True)

RetrieverOpt = Annotated[
    str | None,
    typer.Option(
        "--retriever",
        help="dense (MiniLM + FAISS) | bm25 (bm25s; English stopwords, stemmer CASI_BM25_STEMMER); "
        "default CASI_RETRIEVER. Later commands use CASI_RETRIEVER.",
    ),
]


def _retriever_name(retriever: str | None) -> str:
    name = retriever or get_settings().retriever
    if name not in registered_retrievers():
        fail(f"unknown retriever {name!r} — use one of: {', '.join(registered_retrievers())}")
    return name


@index_app.command("build")
def index_build(
    dataset: DatasetOpt = None, max_docs: MaxDocsOpt = None, retriever: RetrieverOpt = None
) -> None:
    """Build a versioned index under var/ (reused when unchanged): dense embeds the corpus into
    FAISS, bm25 tokenizes it into a bm25s index. Only the corpus is needed (no qrels).

    The slice built here becomes the default of later commands (no --max-docs needed)."""
    settings = get_settings()
    name = _retriever_name(retriever)
    t0 = time.perf_counter()
    r = build_retrieval(
        settings,
        dataset_path=dataset,
        max_docs=max_docs,
        progress_factory=index_progress,
        use_default_slice=False,
        retriever=name,
    )
    remember_default_index(settings, r.dataset.path, max_docs or settings.max_docs)
    verb = "built" if r.built_now else "reused"
    what = (
        f"embedder {r.embedder.version}"
        if name == "dense"
        else f"bm25 k1={settings.bm25_k1} b={settings.bm25_b}, tokenizer {r.retriever.encoder_version}"
    )
    console.print(
        f"{name} index [bold]{r.index.version}[/] {verb}: {len(r.index)} documents, "
        f"{what}, merge {r.merge}, {time.perf_counter() - t0:.1f}s → "
        f"{settings.var_dir / 'index' / r.index.version}"
    )


def _no_qrels(root: Path, split: str, source: str) -> str:
    """One line: where the qrels were looked for, why none is there, and what a dataset is."""
    qrels = root / "qrels"
    if not root.exists():
        why = f"{root} does not exist"
    elif not root.is_dir():
        why = f"{root} is not a folder"
    elif not qrels.is_dir():
        why = f"{root} has no qrels/ folder"
    else:
        why = f"{qrels} holds no <split>.tsv file"
    return (
        f"no qrels for split {split!r}: looked for {qrels / '*.tsv'} ({source}), and {why} — "
        f"point --dataset or CASI_DATASET at a BEIR folder: corpus.jsonl, queries.jsonl and "
        f"qrels/<split>.tsv (such as {split}.tsv), e.g. data/scifact"
    )


@index_app.command("eval")
def index_eval(
    dataset: DatasetOpt = None,
    max_docs: MaxDocsOpt = None,
    split: Annotated[str, typer.Option(help="qrels split to evaluate")] = "test",
    k: Annotated[int, typer.Option(min=1)] = 10,
    recall_k: Annotated[int, typer.Option(min=1, help="also report recall at this depth")] = 100,
    retriever: RetrieverOpt = None,
) -> None:
    """nDCG@k / recall@k / recall@recall-k of the plain query (no rewrites) — the retrieval
    sanity baseline (full SciFact test nDCG@10: dense 0.645, bm25 0.686 stemmed / 0.662 unstemmed)."""
    settings = get_settings()
    name = _retriever_name(retriever)
    root = dataset or settings.dataset
    known = available_splits(root)
    if not known:  # before the (possibly long) index build
        fail(_no_qrels(root, split, "--dataset" if dataset else "CASI_DATASET"))
    if split not in known:
        fail(
            f"no qrels for split {split!r} ({root / 'qrels' / f'{split}.tsv'} not found) — "
            f"use one of: {', '.join(known)}"
        )
    r = build_retrieval(
        settings,
        dataset_path=dataset,
        max_docs=max_docs,
        progress_factory=index_progress,
        retriever=name,
    )
    res = evaluate_retriever(r.dataset, r.retriever, split, k, recall_k)
    table = Table(
        title=f"{name} index {r.index.version}: {split} split, {res['n_queries']} queries, "
        f"{len(r.index)} docs"
    )
    for col in (f"nDCG@{k}", f"recall@{k}", f"recall@{recall_k}"):
        table.add_column(col)
    table.add_row(f"{res['ndcg']:.4f}", f"{res['recall']:.4f}", f"{res[f'recall@{recall_k}']:.4f}")
    console.print(table)
