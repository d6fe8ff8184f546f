"""``casi evaluator fit``: fit the surrogate set scorer on the TRAIN split, then freeze it
(the service: :mod:`app.training.surrogate`)."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import fail
from app.progress import console, index_progress, progress_bar
from app.runtime import build_retrieval
from app.settings import get_settings
from app.training.surrogate import fit_and_freeze
from evaluator.scorers.surrogate_fit import FitConfig

evaluator_app = typer.Typer(help="Fit and inspect the frozen evaluators.", no_args_is_help=True)
AGREEMENT = ("pearson", "spearman", "pair_sign")


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
    try:
        with progress_bar("Fitting surrogate (epochs)", epochs) as advance:
            fitted = fit_and_freeze(
                r, settings.resolved_surrogate_path(), list_k=settings.list_k,
                lists_per_query=lists_per_query,
                config=FitConfig(epochs=epochs, hidden=hidden, seed=seed),
                on_epoch=lambda _epoch, _m: advance(1),
            )  # fmt: skip
    except ValueError as exc:
        fail(str(exc))
        return
    table = Table(title=f"surrogate agreement with replay nDCG@{settings.list_k}")
    for col in ("split", "pearson", "spearman", "pairwise sign"):
        table.add_column(col, justify="right")
    metrics = fitted.fit_metrics
    for key, label in (
        ("before", "val, untrained"),
        ("cosine", "val, zero-shot cosine"),
        ("after", "val, fitted"),
    ):
        table.add_row(label, *(f"{float(metrics[f'{key}_{m}']):.3f}" for m in AGREEMENT))
    table.add_row(
        "TEST, fitted (held out)", *(f"{fitted.test_agreement[m]:.3f}" for m in AGREEMENT)
    )
    console.print(table)
    console.print(
        f"saved {fitted.path} (version {fitted.version}, frozen scorer {fitted.frozen_version}) "
        f"in {time.perf_counter() - t0:.0f}s"
    )
