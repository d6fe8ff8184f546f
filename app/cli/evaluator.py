"""``casi evaluator fit``: fit the surrogate set scorer on the TRAIN split, then freeze it."""

from __future__ import annotations

import random
import time
from typing import Annotated

import torch
import typer
from rich.table import Table

from app.cli.common import fail
from app.progress import console, index_progress, progress_bar
from app.runtime import build_retrieval
from app.settings import get_settings
from evaluator.scorers import QrelsTable
from evaluator.scorers.surrogate import load_surrogate, save_surrogate
from evaluator.scorers.surrogate_fit import (
    FitConfig,
    agreement,
    fit_surrogate,
    make_training_lists,
)

evaluator_app = typer.Typer(help="Fit and inspect the frozen evaluators.", no_args_is_help=True)

VAL_SHARE = 0.15  # train queries held out to pick the best epoch


@evaluator_app.command("fit")
def fit(
    lists_per_query: Annotated[
        int, typer.Option(min=2, help="Coalition-like lists per query.")
    ] = 16,
    epochs: Annotated[int, typer.Option(min=1)] = 20,
    hidden: Annotated[int, typer.Option(min=8)] = 64,
    max_docs: Annotated[int | None, typer.Option("--max-docs", min=1)] = None,
    seed: int = 0,
) -> None:
    """Fit on TRAIN queries (targets: replay nDCG of coalition-like lists), report held-out
    agreement on the TEST split before/after, save with a version hash, frozen."""
    settings = get_settings()
    t0 = time.perf_counter()
    r = build_retrieval(settings, max_docs=max_docs, progress_factory=index_progress)
    ds, doc_emb = r.dataset, torch.from_numpy(r.dense_index().embeddings)
    train_ids = [q for q in ds.split_query_ids("train") if ds.qrels_rows("train")[q]]
    random.Random(seed).shuffle(train_ids)
    n_val = max(1, int(len(train_ids) * VAL_SHARE))
    splits = {
        "train": train_ids[n_val:],
        "val": train_ids[:n_val],
        "test": ds.split_query_ids("test"),
    }
    if len(splits["train"]) < 2:
        fail("need at least 3 judged train queries to fit the surrogate")
    qrels = QrelsTable.from_dict({**ds.qrels_rows("train"), **ds.qrels_rows("test")})
    data = {}
    with console.status("embedding queries and building coalition-like training lists"):
        for name, ids in splits.items():
            emb = torch.from_numpy(r.embedder.encode([ds.queries[q] for q in ids]))
            data[name] = make_training_lists(
                ids,
                emb,
                doc_emb,
                qrels,
                k=settings.list_k,
                n_lists_per_query=lists_per_query,
                seed=seed + len(name),
            )
    with progress_bar("Fitting surrogate (epochs)", epochs) as advance:
        model, metrics = fit_surrogate(
            data["train"],
            data["val"],
            doc_emb=doc_emb,
            config=FitConfig(epochs=epochs, hidden=hidden, seed=seed),
            progress=lambda _epoch, _m: advance(1),
        )
    path = settings.resolved_surrogate_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    version = save_surrogate(model, path)
    frozen = load_surrogate(
        path, doc_emb=doc_emb, k=settings.list_k, doc_fingerprint=r.index.version
    )
    test = data["test"]
    pred = frozen.score(list(test.query_ids), test.query_emb, test.lists)
    after = agreement(pred, test.targets)
    table = Table(title=f"surrogate agreement with replay nDCG@{settings.list_k}")
    for col in ("split", "pearson", "spearman", "pairwise sign"):
        table.add_column(col, justify="right")
    for key, label in (
        ("before", "val, untrained"),
        ("cosine", "val, zero-shot cosine"),
        ("after", "val, fitted"),
    ):
        table.add_row(
            label,
            *(f"{float(metrics[f'{key}_{m}']):.3f}" for m in ("pearson", "spearman", "pair_sign")),
        )
    table.add_row(
        "TEST, fitted (held out)",
        *(f"{float(after[m]):.3f}" for m in ("pearson", "spearman", "pair_sign")),
    )
    console.print(table)
    console.print(
        f"saved {path} (version {version}, frozen scorer {frozen.version}) in {time.perf_counter() - t0:.0f}s"
    )
