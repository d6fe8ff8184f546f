"""BM25 index over a corpus (the ``bm25s`` package), versioned and protected like the FAISS index.

Read first: :func:`build_or_load_bm25`, then :meth:`BM25Index.retrieve`.

**Tokenization** (documents and queries alike, :func:`tokenize`): lower-cased, tokens are the
regex ``(?u)\\b\\w\\w+\\b`` (runs of two or more word characters, scikit-learn's default; one-
character tokens are dropped), English stopwords removed (bm25s's list), then, when
:attr:`BM25Params.stemmer` names one, each token stemmed by PyStemmer (``english``: the
Snowball English stemmer, "Porter2"; BEIR's and Anserini's BM25 baselines stem with Porter;
stopwords are removed before stemming). ``stemmer=None`` is **no stemming** (a claim's "cats"
does not match "cat"). What a document is indexed by is its
:attr:`~evaluator.corpus.Document.retrieval_text` (title + " " + text), as for the embedder.
PyStemmer is imported only when a stemmer is asked for; without it the request fails with one
line naming the package (:func:`check_stemmer`).

**Scoring**: bm25s's ``lucene`` BM25 variant with ``k1`` / ``b`` from :class:`BM25Params`
(default 1.5 / 0.75). A document that shares no token with the query scores 0 and is *not
retrieved* (its row is −1, score −inf): BM25 returns fewer than k documents, or none, for a
query of rare or stop words only. Equal scores rank the smaller row first.

**Rules** (:data:`RULES`, :attr:`BM25Params.rules`, ``CASI_BM25_RULES``): under 2 (the default)
documents and queries are NFKC-normalised before tokenization, as rewrites are (a rewrite that
copies a document's ``µg`` matches it), and the top k is exact: among documents tied at the
k-th score the smaller rows are kept, so the depth-10 list is the first 10 of the depth-100
list. Under 1 the text is read as written and bm25s cuts the top k itself (among documents
tied at the cut it keeps larger rows, and which depends on k); a pre-registered protocol that
names no rules runs under 1, the rules its cells were made with.

**Versioning and integrity**: the version hashes the retriever name, the parameters, the
tokenizer settings (the stemmer among them, and PyStemmer's version when one is used: an
unstemmed index's version is what it was before stemming existed), the ``bm25s`` version and
the corpus content (:func:`bm25_version`); the index lives in ``<var>/index/<version>/`` with
a ``manifest.json`` (size + sha256 of every file), is written atomically and rebuilt when
absent or damaged. Unlike the FAISS index (whose two copies of the vectors cross-check each
other), the BM25 files hold no redundancy, so every load hashes them in full (a few MB for
SciFact): same-mtime bit rot is caught too. There is no older BM25 format to adopt, so a
folder without its manifest is damaged and rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import shutil
import unicodedata
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evaluator.artifacts import (
    ArtifactError,
    make_temp_dir,
    remove_temp_dir,
    replace_dir,
    verify_folder,
    write_manifest,
)
from evaluator.corpus import Document
from evaluator.index import INDEX_DIRNAME, TMP_PREFIX, corpus_fingerprint
from evaluator.locks import build_lock

log = logging.getLogger(__name__)

KIND = "BM25 index"
MODEL_DIR = "bm25s"


@functools.cache
def _bm25s() -> Any:
    """The bm25s module, imported on first use: it pulls numba (~0.8 s), which every ``casi``
    command would pay at start-up while only the bm25 retriever needs it."""
    import bm25s  # lazy third-party import: see the docstring

    return bm25s


RETRIEVER_NAME = "bm25"

STEMMERS = ("english",)
"""PyStemmer algorithms :attr:`BM25Params.stemmer` may name (None: no stemming)."""

STEMMER_PACKAGE = "PyStemmer"


def _stemmer_module() -> Any:
    """The PyStemmer module (``Stemmer``); ValueError naming what to install when it is absent."""
    try:
        import Stemmer  # lazy third-party import: only stemmed indexes need it
    except ImportError:
        raise ValueError(
            f"BM25 stemming needs the {STEMMER_PACKAGE} package, which is not installed — "
            f"pip install {STEMMER_PACKAGE} (or use no stemming)"
        ) from None
    return Stemmer


def check_stemmer(stemmer: str | None) -> None:
    """ValueError (one line) unless ``stemmer`` is None or a usable stemmer of :data:`STEMMERS`."""
    if stemmer is None:
        return
    if stemmer not in STEMMERS:
        valid = ", ".join(("none", *STEMMERS))
        raise ValueError(f"unknown BM25 stemmer {stemmer!r}; valid: {valid}")
    _stemmer_module()


def stemmer_version() -> str:
    """PyStemmer's version (part of a stemmed index's version)."""
    _stemmer_module()
    return importlib.metadata.version(STEMMER_PACKAGE)


RULES = {
    1: "the text as written; the top k as bm25s cuts it (documents tied at the cut: the larger "
    "rows kept)",
    2: "documents and queries NFKC-normalised as rewrites are (µ = μ, ﬁ = fi); the exact top k "
    "(documents tied at the cut: the smaller rows kept)",
}
"""The BM25 rule sets :attr:`BM25Params.rules` may name (``CASI_BM25_RULES``); a pre-registered
protocol that names none runs under 1, the rules its cells were made with."""
LATEST_RULES = 2


@dataclass(frozen=True)
class BM25Params:
    """BM25 and tokenizer settings; every field is part of the index version."""

    k1: float = 1.5
    b: float = 0.75
    method: str = "lucene"
    stopwords: str = "english"
    token_pattern: str = r"(?u)\b\w\w+\b"
    lower: bool = True
    stemmer: str | None = None  # None: no stemming; "english": PyStemmer's Snowball English
    rules: int = LATEST_RULES  # see RULES: how text is read and where the top k is cut

    def __post_init__(self) -> None:
        if self.k1 < 0 or not 0 <= self.b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={self.k1}, b={self.b}")
        if self.rules not in RULES:
            raise ValueError(f"BM25 rules must be one of {sorted(RULES)}, got {self.rules!r}")
        check_stemmer(self.stemmer)

    def canonical(self) -> str:
        """The parameters as hashed into the versions; rules 1 hashes exactly the text it
        hashed before the field existed (its indexes and cached lists keep their versions)."""
        fields = asdict(self)
        if self.rules == 1:
            del fields["rules"]
        return json.dumps(fields, sort_keys=True)


def tokenize(texts: Sequence[str], params: BM25Params) -> list[list[str]]:
    """Token lists of ``texts`` (see the module docstring); an empty list for no tokens."""
    # a fresh PyStemmer object per call: they are not thread-safe (the API tokenizes queries
    # from several threads), and building one costs microseconds
    stemmer = None if params.stemmer is None else _stemmer_module().Stemmer(params.stemmer)
    if params.rules >= 2:  # as `evaluator.actions.normalize_rewrite` reads a rewrite
        texts = [unicodedata.normalize("NFKC", t) for t in texts]
    out = _bm25s().tokenize(
        list(texts),
        lower=params.lower,
        token_pattern=params.token_pattern,
        stopwords=params.stopwords,
        stemmer=stemmer,
        return_ids=False,
        show_progress=False,
    )
    return [list(t) for t in out]


def encoder_version(params: BM25Params) -> str:
    """Version of the query side (tokenizer + scoring), the BM25 analogue of an embedder's.

    A stemmed tokenizer adds PyStemmer's version; an unstemmed one hashes exactly the text it
    hashed before stemming existed (its indexes keep their versions)."""
    text = f"{RETRIEVER_NAME}|{params.canonical()}|bm25s {_bm25s().__version__}"
    if params.stemmer is not None:
        text += f"|{STEMMER_PACKAGE} {stemmer_version()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def bm25_version(documents: Sequence[Document], params: BM25Params) -> str:
    """Index version: retriever + parameters + tokenizer + bm25s version + corpus content."""
    text = f"{corpus_fingerprint(documents)}|{encoder_version(params)}|{RETRIEVER_NAME}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class BM25Index:
    """A loaded BM25 index; satisfies :class:`evaluator.retrievers.Retriever`."""

    version: str
    doc_ids: list[str]
    params: BM25Params
    model: Any  # bm25s.BM25
    name: str = RETRIEVER_NAME

    @property
    def encoder_version(self) -> str:
        return encoder_version(self.params)

    def __len__(self) -> int:
        return len(self.doc_ids)

    def retrieve(self, texts: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """texts → (rows (n, k) int64, −1 padded; scores (n, k) float32, −inf padded).

        Only documents sharing a token with the query are retrieved; ties: smaller row first.
        """
        n = len(texts)
        rows = np.full((n, k), -1, dtype=np.int64)
        scores = np.full((n, k), -np.inf, dtype=np.float32)
        depth = min(k, len(self.doc_ids))
        if n == 0 or depth == 0:
            return rows, scores
        tokens = tokenize(texts, self.params)
        if self.params.rules >= 2:
            found, got = _exact_top(self.model, tokens, depth)
        else:
            found, got = self.model.retrieve(tokens, k=depth, show_progress=False, n_threads=0)
        found, got = np.asarray(found, dtype=np.int64), np.asarray(got, dtype=np.float32)
        order = np.lexsort((found, -got), axis=1)  # score descending, then row ascending
        found, got = np.take_along_axis(found, order, 1), np.take_along_axis(got, order, 1)
        hit = got > 0
        rows[:, :depth] = np.where(hit, found, -1)
        scores[:, :depth] = np.where(hit, got, -np.inf)
        # hits come first in every row (scores sorted descending, misses score 0)
        return rows, scores


def _exact_top(model: Any, tokens: list[list[str]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, scores) (n, k) of every query's exact top k over all documents: score descending,
    and among documents tied at the cut the smaller rows (bm25s's own cut keeps arbitrary ones)."""
    n_docs = int(model.scores["num_docs"])
    rows = np.empty((len(tokens), k), dtype=np.int64)
    scores = np.empty((len(tokens), k), dtype=np.float32)
    for i, query in enumerate(tokens):
        all_scores = (
            np.asarray(model.get_scores(query), dtype=np.float32)
            if query  # get_scores refuses an empty token list
            else np.zeros(n_docs, dtype=np.float32)
        )
        if k < n_docs:  # the k-th best score; everything above it, then ties by row
            kth = np.partition(all_scores, n_docs - k)[n_docs - k]
            above = np.flatnonzero(all_scores > kth)
            tied = np.flatnonzero(all_scores == kth)[: k - above.size]
            picked = np.concatenate([above, tied])
        else:
            picked = np.arange(n_docs)
        picked = picked[np.lexsort((picked, -all_scores[picked]))]
        rows[i], scores[i] = picked, all_scores[picked]
    return rows, scores


def _fit(documents: Sequence[Document], params: BM25Params) -> Any:
    """The fitted ``bm25s`` model; a corpus in which no document has a single token (all
    stopwords, one-letter words, punctuation) is refused with a DatasetError naming it."""
    from evaluator.corpus import DatasetError  # a subclass of ValueError

    tokens = tokenize([d.retrieval_text for d in documents], params)
    if not any(tokens):  # bm25s would fail with "max() arg is an empty sequence"
        ids = ", ".join(repr(d.doc_id) for d in documents[:3])
        more = f", … ({len(documents)} documents)" if len(documents) > 3 else ""
        raise DatasetError(
            f"BM25 cannot index the corpus [{ids}{more}]: no document has a token left after "
            f"tokenization (runs matching {params.token_pattern!r}, "
            f"stopwords {params.stopwords!r} removed); use the dense retriever"
        )
    model = _bm25s().BM25(k1=params.k1, b=params.b, method=params.method)
    model.index(tokens, show_progress=False)
    return model


def _save(path: Path, index: BM25Index) -> None:
    """Write the folder in a temporary sibling with its manifest, then rename it in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(path.parent, f"{TMP_PREFIX}{index.version}-")
    try:
        index.model.save(str(tmp / MODEL_DIR), show_progress=False)
        (tmp / "doc_ids.json").write_text(json.dumps(index.doc_ids))
        meta = {
            "version": index.version,
            "retriever": RETRIEVER_NAME,
            "n_docs": len(index.doc_ids),
            "params": asdict(index.params),
            "bm25s_version": _bm25s().__version__,
        }
        if index.params.stemmer is not None:
            meta["stemmer_version"] = f"{STEMMER_PACKAGE} {stemmer_version()}"
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        write_manifest(tmp)
        replace_dir(tmp, path)  # a half-written index is never picked up
    finally:
        remove_temp_dir(tmp)


def _read(path: Path) -> tuple[dict[str, Any], list[str], Any]:
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        doc_ids = json.loads((path / "doc_ids.json").read_text(encoding="utf-8"))
        model = _bm25s().BM25.load(str(path / MODEL_DIR), mmap=False, show_progress=False)
    except (OSError, ValueError, EOFError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ArtifactError(path, f"unreadable ({type(exc).__name__})", kind=KIND) from None
    if not isinstance(meta, dict) or not isinstance(doc_ids, list):
        raise ArtifactError(path, "meta.json or doc_ids.json has the wrong shape", kind=KIND)
    return meta, doc_ids, model


def _check_consistent(
    path: Path, version: str, parts: tuple[dict[str, Any], list[str], Any], expected: Sequence[str]
) -> None:
    meta, doc_ids, model = parts
    n = len(doc_ids)
    scores = getattr(model, "scores", {})
    indptr = np.asarray(scores.get("indptr", []), dtype=np.int64)
    indices, data = np.asarray(scores.get("indices", [])), np.asarray(scores.get("data", []))
    csc_sound = (
        indptr.size > 0
        and indptr[0] == 0
        and bool((np.diff(indptr) >= 0).all())
        and indptr[-1] == indices.size == data.size
        and len(getattr(model, "vocab_dict", {})) >= indptr.size - 1
    )
    problems = [
        (meta.get("version") != version or meta.get("retriever") != RETRIEVER_NAME, "meta.json"),
        (meta.get("n_docs") != n, "meta.json and doc_ids.json disagree on the size"),
        (scores.get("num_docs") != n, "the BM25 matrix has another number of documents"),
        (not csc_sound, "the BM25 matrix is not a sound sparse matrix over the vocabulary"),
        (indices.size > 0 and int(indices.max()) >= n, "document row out of range"),
        (list(expected) != doc_ids, "doc_ids.json ≠ corpus"),
    ]
    for bad, what in problems:
        if bad:
            raise ArtifactError(path, f"inconsistent ({what})", kind=KIND)


def load_bm25(
    var_dir: Path, version: str, params: BM25Params, expected_ids: Sequence[str]
) -> BM25Index | None:
    """The saved index of ``version``; None when absent; :class:`ArtifactError` when damaged."""
    path = Path(var_dir) / INDEX_DIRNAME / version
    if not path.exists():
        return None
    verify_folder(path, deep=True, kind=KIND)  # no manifest → damaged (see the module docstring)
    parts = _read(path)
    _check_consistent(path, version, parts, expected_ids)
    return BM25Index(version, parts[1], params, parts[2])


def _load_or_none(
    var_dir: Path, version: str, params: BM25Params, ids: Sequence[str], warn: bool
) -> BM25Index | None:
    try:
        return load_bm25(var_dir, version, params, ids)
    except ArtifactError as exc:
        if warn:
            log.warning("BM25 index %s is damaged (%s): rebuilding it", exc.artifact, exc.problem)
        return None


def build_or_load_bm25(
    documents: Sequence[Document], var_dir: Path, params: BM25Params | None = None
) -> tuple[BM25Index, bool]:
    """Return (index, built_now): the saved index of this version, else a fresh build (saved).

    A damaged or incomplete folder is rebuilt with a warning; builds hold the same inter-process
    lock as the FAISS index (a second process waits, then loads what the first one wrote).
    """
    params = params or BM25Params()
    version = bm25_version(documents, params)
    path = Path(var_dir) / INDEX_DIRNAME / version
    ids = [d.doc_id for d in documents]
    found = _load_or_none(var_dir, version, params, ids, warn=False)
    if found is not None:
        return found, False
    with build_lock(path, f"BM25 index {version}"):
        found = _load_or_none(var_dir, version, params, ids, warn=True)
        if found is not None:
            return found, False
        for stale in path.parent.glob(f"{TMP_PREFIX}{version}-*"):  # crashed earlier builds
            shutil.rmtree(stale, ignore_errors=True)
        index = BM25Index(version, ids, params, _fit(documents, params))
        _save(path, index)
    return index, True
