"""Composition root helpers: build the heavy components once from :class:`Settings`.

The CLI and the API lifespan call these; library code never reads settings itself.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import faiss
import torch

from app.db.connect import migrate_to_head
from app.errors import CasiError, SettingsError
from app.settings import Settings
from evaluator.actions import ActionExecutor
from evaluator.artifacts import atomic_write_text
from evaluator.bm25 import STEMMER_PACKAGE, BM25Index, check_stemmer
from evaluator.cache import ActionCache, connect_redis
from evaluator.corpus import Dataset, load_dataset
from evaluator.embed import Embedder
from evaluator.feedback import FeedbackContext
from evaluator.index import DocIndex, build_or_load
from evaluator.prf import KeywordExpansion
from evaluator.rerank import PoolReranker
from evaluator.retrievers import (
    DenseRetriever,
    Retriever,
    RetrieverSpec,
    build_retriever,
    check_retriever,
)
from evaluator.scorers import SetScorer, make_scorer
from evaluator.scorers.registry import Metric, registered_scorers

log = logging.getLogger(__name__)
DEFAULT_INDEX_FILE = "default.json"  # under var/index/: the slice `casi index build` built last


def configure_threads(settings: Settings) -> None:
    torch.set_num_threads(settings.threads)
    faiss.omp_set_num_threads(settings.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def check_var_dir(var_dir: Path) -> None:
    """The var folder exists (it is created) and is writable: checked before expensive work.

    A folder that cannot be created says so, with the OS's reason and the nearest folder that
    does exist (under /proc or /sys, for one, the kernel creates nothing: "No such file or
    directory" though /proc exists); one that exists but takes no file says that."""
    var_dir = Path(var_dir)
    where = f"CASI_VAR_DIR={var_dir}"
    try:
        var_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parent = _nearest_existing(var_dir)
        kernel = parent.parts[1:2] in (("proc",), ("sys",)) and parent.is_absolute()
        note = f"; {parent} is a kernel file system, where no folder can be made" if kernel else ""
        raise CasiError(
            f"cannot create the var folder {var_dir}: the OS refused to make "
            f"{exc.filename or var_dir} inside {parent} ({_os_reason(exc)}{note})",
            where,
            "point CASI_VAR_DIR at a folder you can write to, on a regular disk (created if "
            "absent), e.g. var/ in the repository",
        ) from None
    try:
        with tempfile.NamedTemporaryFile(dir=var_dir, prefix=".probe-"):
            pass
    except OSError as exc:
        raise CasiError(
            f"cannot write to the var folder {var_dir}: {_os_reason(exc)}",
            where,
            "make it writable, or point CASI_VAR_DIR at a folder you can write to",
        ) from None


def _nearest_existing(path: Path) -> Path:
    return next((p for p in (path, *path.parents) if p.exists()), Path("."))


def _os_reason(exc: OSError) -> str:
    """``No such file or directory, ENOENT``: the message and the error's name."""
    name = errno.errorcode.get(exc.errno or 0, "")
    reason = exc.strerror or str(exc)
    return f"{reason}, {name}" if name else reason


def preflight(settings: Settings, *, database: bool = False, device: bool = True) -> None:
    """Fail fast, in seconds: var folder, device and, when ``database``, the database (which is
    then migrated to head). Settings were validated when they were read."""
    check_var_dir(settings.var_dir)
    if device:
        settings.resolved_device()
    if database:
        migrate_to_head(settings)


def _default_index_file(settings: Settings) -> Path:
    return settings.var_dir / "index" / DEFAULT_INDEX_FILE


def remember_default_index(settings: Settings, dataset: Path, max_docs: int | None) -> None:
    """Record the slice `casi index build` just built: later commands default to it."""
    record = {"dataset": str(Path(dataset).resolve()), "max_docs": max_docs}
    atomic_write_text(_default_index_file(settings), json.dumps(record))


def resolve_max_docs(settings: Settings, dataset: Path, max_docs: int | None) -> int | None:
    """--max-docs, else CASI_MAX_DOCS, else the slice `casi index build` last built for this
    dataset (so `make demo-list`'s 500-document index is the one later commands use), else all."""
    if max_docs is not None or settings.max_docs is not None:
        return max_docs or settings.max_docs
    try:
        record = json.loads(_default_index_file(settings).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    n = record.get("max_docs") if isinstance(record, dict) else None
    if isinstance(n, int) and record.get("dataset") == str(Path(dataset).resolve()):
        log.info(
            "using the --max-docs %d slice `casi index build` built last (--max-docs overrides)", n
        )
        return n
    return None


def bm25_params(settings: Settings) -> dict[str, Any]:
    """The BM25 parameters of the settings; a stemmer whose package is missing is a
    SettingsError naming what to install (before any index work)."""
    params = settings.bm25_params()
    try:
        check_stemmer(params["stemmer"])
    except ValueError as exc:
        if STEMMER_PACKAGE not in str(exc):
            raise SettingsError(str(exc), "CASI_BM25_STEMMER") from None
        raise SettingsError(
            f"CASI_BM25_STEMMER={settings.bm25_stemmer} needs the {STEMMER_PACKAGE} package, "
            "which is not installed",
            None,
            f"pip install {STEMMER_PACKAGE}, or set CASI_BM25_STEMMER=none",
        ) from None
    return params


@dataclass
class Retrieval:
    """Everything needed to execute actions: dataset, embedder, index, cache, executor.

    ``index`` is the retriever's index: a FAISS :class:`DocIndex` (``CASI_RETRIEVER=dense``) or
    a :class:`~evaluator.bm25.BM25Index` (``bm25``); both have ``version`` and ``len``.
    ``retriever`` / ``merge`` / ``rrf_k``: the retrieval environment (the executor carries the
    merge rule too, so ``compute_credits(..., retrieval.executor, ...)`` uses it).
    """

    dataset: Dataset
    embedder: Embedder
    index: DocIndex | BM25Index
    cache: ActionCache
    executor: ActionExecutor
    built_now: bool
    redis_client: Any
    max_docs: int | None = None  # the slice actually used (--max-docs, CASI_MAX_DOCS or remembered)
    var_dir: Path | None = None  # where a dense index for embedding scorers is built (bm25)
    use_gpu: bool = False
    progress_factory: Callable[[int], Any] | None = field(default=None, repr=False)
    _dense: DocIndex | None = field(default=None, repr=False)
    _feedback: FeedbackContext | None = field(default=None, repr=False)

    @property
    def retriever(self) -> Retriever:
        return self.executor.retriever

    @property
    def merge(self) -> str:
        return self.executor.merge

    @property
    def rrf_k(self) -> float:
        return self.executor.rrf_k

    def executor_at(self, k: int) -> ActionExecutor:
        """An executor retrieving top-``k`` (its own cache keys: k is part of the key)."""
        if k == self.executor.k:
            return self.executor
        ex = self.executor
        cache = ActionCache(
            self.redis_client, ex.retriever.version, ex.retriever.encoder_version, k,
            self.cache.ttl_s,
        )  # fmt: skip
        return ActionExecutor(self.embedder, self.index, cache, merge=ex.merge, rrf_k=ex.rrf_k)

    def feedback(self) -> FeedbackContext:
        """THE feedback context builder of this game (`evaluator.feedback`): the game's executor
        (the query's own list, cached) and keyword expansion over the indexed documents, built
        once. Serving, training, evaluation, the warm start and the audit all read it."""
        if self._feedback is None:
            texts = [d.retrieval_text for d in self.dataset.documents]
            self._feedback = FeedbackContext(self.executor, KeywordExpansion(texts))
        return self._feedback

    def reranker(self) -> PoolReranker | None:
        """THE served second stage of the pooled game (`evaluator.rerank`: the pool re-ranked
        by BM25 of the query and the rewrites' words), on a BM25 index; None on a dense one."""
        return PoolReranker(self.index) if isinstance(self.index, BM25Index) else None

    def dense_index(self) -> DocIndex:
        """The MiniLM FAISS index of the same documents (what embedding scorers — cosine,
        surrogate — read document vectors from): the retriever's own index when dense, else
        built (or loaded) once under the var folder."""
        if isinstance(self.index, DocIndex):
            return self.index
        if self._dense is None:
            self._dense, _ = build_or_load(
                self.dataset.documents, self.embedder, self.var_dir or Path("var"),
                self.progress_factory, use_gpu=self.use_gpu,
            )  # fmt: skip
        return self._dense


def build_retrieval(
    settings: Settings,
    *,
    dataset_path: Path | None = None,
    max_docs: int | None = None,
    progress_factory: Callable[[int], Any] | None = None,
    use_default_slice: bool = True,
    retriever: str | None = None,
    report: Callable[[str], None] | None = None,
) -> Retrieval:
    """Load data, embedder, index (building it if its version is new), Redis and the executor.

    ``retriever``: dense | bm25 (default CASI_RETRIEVER); the merge rule is CASI_MERGE (auto:
    the retriever's default, max for dense, rrf for bm25) with CASI_RRF_K; bm25 takes
    CASI_BM25_K1 / CASI_BM25_B / CASI_BM25_STEMMER. ``progress_factory(total)`` returns a
    context manager yielding an ``advance(n)`` callable; it is only used when a dense index has
    to be built. Without ``max_docs`` (and CASI_MAX_DOCS) the slice ``casi index build`` last
    built is used (:func:`resolve_max_docs`). ``report(text)`` is told each step as it begins
    (the API's start-up says what it is doing).
    """
    say = report or (lambda _text: None)
    preflight(settings)
    configure_threads(settings)
    name = check_retriever(retriever or settings.retriever)
    root = Path(dataset_path or settings.dataset)
    if use_default_slice:
        max_docs = resolve_max_docs(settings, root, max_docs)
    max_docs = max_docs or settings.max_docs
    say(f"loading the dataset {root}" + (f" (first {max_docs} documents)" if max_docs else ""))
    dataset = load_dataset(root, max_docs=max_docs)
    say("loading the embedder")
    embedder = Embedder(device=settings.resolved_device())
    use_gpu = settings.resolved_device().startswith("cuda")
    spec = RetrieverSpec(
        dataset.documents, settings.var_dir, embedder, progress_factory, use_gpu,
        params=bm25_params(settings) if name == "bm25" else None,
    )  # fmt: skip
    say(f"opening the {name} index of {len(dataset.documents)} documents")
    found, built = build_retriever(name, spec)
    index = found.index if isinstance(found, DenseRetriever) else found
    if not isinstance(index, DocIndex | BM25Index):
        raise TypeError(f"retriever {name!r} built an index of type {type(index).__name__}")
    say("connecting to Redis" if settings.redis_url else "starting the embedded Redis server")
    client = connect_redis(settings.redis_url, settings.var_dir)
    cache = ActionCache(
        client, found.version, found.encoder_version, settings.retrieval_k, settings.cache_ttl_s
    )
    executor = ActionExecutor(
        embedder, index, cache, merge=settings.resolved_merge(name), rrf_k=settings.rrf_k
    )
    return Retrieval(
        dataset, embedder, index, cache, executor, built, client, max_docs,
        var_dir=settings.var_dir, use_gpu=use_gpu, progress_factory=progress_factory,
    )  # fmt: skip


def build_scorer(
    name: str, settings: Settings, retrieval: Retrieval, split: str | None = None
) -> SetScorer:
    """The evaluator ``name`` (replay | cosine | surrogate) on the configured device; replay
    reads the qrels of ``split`` (every loaded split when None) and measures the game's value
    (CASI_GAME: nDCG@CASI_LIST_K of a list, or graded recall of a pool). The one place scorers are built
    from settings: the CLI, the training services and the API lifespan call it."""
    ds = retrieval.dataset
    qrels: dict[str, dict[int, int]] = {}
    for s in [split] if split else list(ds.qrels):
        qrels.update(ds.qrels_rows(s))  # a missing split: DatasetError naming its file
    check_evaluator(name, settings)
    path = settings.resolved_surrogate_path()
    dense = None if name == "replay" else retrieval.dense_index()  # replay reads no vectors
    return make_scorer(
        name,
        qrels=qrels if name == "replay" else None,
        doc_emb=None if dense is None else torch.from_numpy(dense.embeddings),
        k=settings.scorer_k() if name == "replay" else settings.list_k,
        metric=cast(Metric, settings.scorer_metric() if name == "replay" else "ndcg"),
        surrogate_path=path if name == "surrogate" else None,
        device=settings.resolved_device(),
        doc_fingerprint=None if dense is None else dense.version,
    )


def check_evaluator(name: str, settings: Settings) -> None:
    """Refuse, before anything is built or embedded, an evaluator :func:`build_scorer` would
    refuse: a name no scorer is registered under, or the surrogate before it was fitted."""
    if name not in registered_scorers():
        raise ValueError(f"unknown evaluator {name!r} — valid: {', '.join(registered_scorers())}")
    path = settings.resolved_surrogate_path()
    if name == "surrogate" and not path.is_file():
        raise FileNotFoundError(f"no fitted surrogate at {path}: run `casi evaluator fit` first")


def build_scorers(
    settings: Settings, retrieval: Retrieval, names: Sequence[str] | None = None
) -> dict[str, SetScorer]:
    """The scorers ``names`` by name (:func:`build_scorer`, qrels of every loaded split); None:
    every scorer this machine has — replay, cosine, and surrogate once one was fitted."""
    if names is None:
        fitted = settings.resolved_surrogate_path().is_file()
        names = ["replay", "cosine", *(["surrogate"] if fitted else [])]
    return {name: build_scorer(name, settings, retrieval) for name in dict.fromkeys(names)}
