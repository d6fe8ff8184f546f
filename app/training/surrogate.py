"""`casi evaluator fit`: fit the surrogate set scorer on the TRAIN split, freeze it, and measure
its agreement with replay on the TEST split. Read :func:`fit_and_freeze`.

Targets are replay nDCG@K of coalition-like lists per query (`make_training_lists`); a seeded
share of the judged TRAIN queries (:data:`VAL_SHARE`) picks the best epoch; the TEST split is
held out and only measured, on the frozen scorer as it is saved (with its version hash).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from app.runtime import Retrieval
from evaluator.scorers import QrelsTable
from evaluator.scorers.surrogate import load_surrogate, save_surrogate
from evaluator.scorers.surrogate_fit import (
    FitConfig,
    agreement,
    fit_surrogate,
    make_training_lists,
)

VAL_SHARE = 0.15  # train queries held out to pick the best epoch


@dataclass
class FittedSurrogate:
    path: Path
    version: str  # of the saved weights
    frozen_version: str  # of the frozen scorer loaded back
    fit_metrics: dict[str, float]  # val agreement: before / zero-shot cosine / after
    test_agreement: dict[str, float]  # held-out TEST agreement of the frozen scorer


def query_splits(retrieval: Retrieval, seed: int) -> dict[str, list[str]]:
    """Judged TRAIN queries, shuffled by ``seed``: train and val (:data:`VAL_SHARE`); TEST."""
    ds = retrieval.dataset
    train_ids = [q for q in ds.split_query_ids("train") if ds.qrels_rows("train")[q]]
    random.Random(seed).shuffle(train_ids)
    n_val = max(1, int(len(train_ids) * VAL_SHARE))
    if len(train_ids) - n_val < 2:
        raise ValueError("need at least 3 judged train queries to fit the surrogate")
    return {
        "train": train_ids[n_val:],
        "val": train_ids[:n_val],
        "test": ds.split_query_ids("test"),
    }


def fit_and_freeze(
    retrieval: Retrieval,
    path: Path,
    *,
    list_k: int,
    lists_per_query: int,
    config: FitConfig,
    on_epoch: Callable[[int, dict[str, float]], None] | None = None,
) -> FittedSurrogate:
    """Build the training lists, fit, save to ``path`` (frozen), measure on TEST."""
    ds, doc_emb = retrieval.dataset, torch.from_numpy(retrieval.dense_index().embeddings)
    splits = query_splits(retrieval, config.seed)
    qrels = QrelsTable.from_dict({**ds.qrels_rows("train"), **ds.qrels_rows("test")})
    data = {}
    for name, ids in splits.items():
        emb = torch.from_numpy(retrieval.embedder.encode([ds.queries[q] for q in ids]))
        data[name] = make_training_lists(
            ids, emb, doc_emb, qrels, k=list_k, n_lists_per_query=lists_per_query,
            seed=config.seed + len(name),
        )  # fmt: skip
    model, metrics = fit_surrogate(
        data["train"], data["val"], doc_emb=doc_emb, config=config,
        progress=on_epoch,
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    version = save_surrogate(model, path)
    frozen = load_surrogate(
        path, doc_emb=doc_emb, k=list_k, doc_fingerprint=retrieval.index.version
    )
    test = data["test"]
    after = agreement(frozen.score(list(test.query_ids), test.query_emb, test.lists), test.targets)
    test_agreement = {k: float(v) for k, v in after.items()}
    return FittedSurrogate(path, version, frozen.version, dict(metrics), test_agreement)
