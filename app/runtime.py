"""Composition root helpers: build the heavy components once from :class:`Settings`.

The CLI and the API lifespan call these; library code never reads settings itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.settings import Settings
from evaluator.actions import ActionExecutor
from evaluator.cache import ActionCache, connect_redis
from evaluator.corpus import Dataset, load_dataset
from evaluator.embed import Embedder
from evaluator.index import DocIndex, build_or_load


def configure_threads(settings: Settings) -> None:
    import faiss
    import torch

    torch.set_num_threads(settings.threads)
    faiss.omp_set_num_threads(settings.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class Retrieval:
    """Everything needed to execute actions: dataset, embedder, index, cache, executor."""

    dataset: Dataset
    embedder: Embedder
    index: DocIndex
    cache: ActionCache
    executor: ActionExecutor
    built_now: bool
    redis_client: Any


def build_retrieval(
    settings: Settings,
    *,
    dataset_path: Path | None = None,
    max_docs: int | None = None,
    progress_factory: Callable[[int], Any] | None = None,
) -> Retrieval:
    """Load data, embedder, index (building it if its version is new), Redis and the executor.

    ``progress_factory(total)`` returns a context manager yielding a ``advance(n)`` callable; it
    is only used when the index has to be built.
    """
    configure_threads(settings)
    dataset = load_dataset(dataset_path or settings.dataset, max_docs=max_docs or settings.max_docs)
    embedder = Embedder(device=settings.resolved_device())
    index, built = build_or_load(
        dataset.documents,
        embedder,
        settings.var_dir,
        progress_factory,
        use_gpu=settings.resolved_device().startswith("cuda"),
    )
    client = connect_redis(settings.redis_url, settings.var_dir)
    cache = ActionCache(
        client, index.version, embedder.version, settings.retrieval_k, settings.cache_ttl_s
    )
    return Retrieval(
        dataset, embedder, index, cache, ActionExecutor(embedder, index, cache), built, client
    )
