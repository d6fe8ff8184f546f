"""FAISS index over the frozen embeddings of a corpus, versioned by content hash.

Read first: :func:`build_or_load`. The version is a hash of (document ids + texts, embedder
version); the index lives in ``<var>/index/<version>/`` and is rebuilt only when one of those
inputs changes, or when the saved folder is damaged (checked against its manifest and by
cross-checks, see :func:`load_index`). Rows of the index are the integer document ids used
everywhere downstream.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from evaluator.artifacts import (
    ArtifactError,
    has_manifest,
    make_temp_dir,
    remove_temp_dir,
    replace_dir,
    verify_folder,
    write_manifest,
)
from evaluator.corpus import Document
from evaluator.embed import Embedder
from evaluator.locks import build_lock

log = logging.getLogger(__name__)

INDEX_DIRNAME = "index"
TMP_PREFIX = ".tmp-"
KIND = "index"


def corpus_fingerprint(documents: Sequence[Document]) -> str:
    h = hashlib.sha256()
    for d in documents:
        h.update(d.doc_id.encode())
        h.update(b"\x00")
        h.update(d.retrieval_text.encode())
        h.update(b"\x01")
    return h.hexdigest()


def index_version(documents: Sequence[Document], embedder_version: str) -> str:
    return hashlib.sha256(
        f"{corpus_fingerprint(documents)}|{embedder_version}|flatip".encode()
    ).hexdigest()[:12]


def _gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


@dataclass
class DocIndex:
    """Searchable index: ``search`` returns rows (−1 padded) and inner-product scores."""

    version: str
    doc_ids: list[str]
    embeddings: np.ndarray  # (n_docs, d) float32, L2-normalised
    index: Any  # faiss.Index (CPU, or GPU when faiss-gpu and CUDA are present)

    @classmethod
    def from_embeddings(
        cls,
        version: str,
        doc_ids: list[str],
        emb: np.ndarray,
        use_gpu: bool = False,
        cpu: Any = None,
    ) -> DocIndex:
        if cpu is None:
            cpu = faiss.IndexFlatIP(emb.shape[1])
            cpu.add(np.ascontiguousarray(emb, dtype=np.float32))
        index: Any = cpu
        if use_gpu and _gpu_available():  # pragma: no cover - needs CUDA
            index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, cpu)
        return cls(version, doc_ids, emb, index)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """queries (n, d) float32 → (rows (n, k) int64, scores (n, k) float32)."""
        scores, rows = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        return rows.astype(np.int64), scores.astype(np.float32)

    def __len__(self) -> int:
        return len(self.doc_ids)


def _save(
    path: Path, version: str, doc_ids: list[str], emb: np.ndarray, meta: dict[str, Any]
) -> None:
    """Write the index folder in a temporary sibling with its manifest, then rename it in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(path.parent, f"{TMP_PREFIX}{version}-")
    try:
        np.save(tmp / "embeddings.npy", emb)
        (tmp / "doc_ids.json").write_text(json.dumps(doc_ids))
        (tmp / "meta.json").write_text(json.dumps({"version": version, **meta}, indent=2))
        flat = faiss.IndexFlatIP(emb.shape[1])
        flat.add(np.ascontiguousarray(emb, dtype=np.float32))
        faiss.write_index(flat, str(tmp / "index.faiss"))
        write_manifest(tmp)
        replace_dir(tmp, path)  # a half-written index is never picked up
    finally:
        remove_temp_dir(tmp)


def _read(path: Path) -> tuple[dict[str, Any], list[str], np.ndarray, Any]:
    """(meta, doc ids, embeddings, faiss index) of a folder; unreadable → ArtifactError."""
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        doc_ids = json.loads((path / "doc_ids.json").read_text(encoding="utf-8"))
        emb = np.load(path / "embeddings.npy", allow_pickle=False)
        cpu = faiss.read_index(str(path / "index.faiss"))
    except (OSError, ValueError, EOFError, RuntimeError, UnicodeDecodeError) as exc:
        raise ArtifactError(path, f"unreadable ({type(exc).__name__})", kind=KIND) from None
    if not isinstance(meta, dict) or not isinstance(doc_ids, list):
        raise ArtifactError(path, "meta.json or doc_ids.json has the wrong shape", kind=KIND)
    return meta, doc_ids, emb, cpu


def _check_consistent(
    path: Path,
    version: str,
    parts: tuple[dict[str, Any], list[str], np.ndarray, Any],
    expected_ids: Sequence[str] | None,
) -> None:
    """Cross-checks that catch damage even without a manifest (an index of an older CASI)."""
    meta, doc_ids, emb, cpu = parts
    n = len(doc_ids)
    problems = [
        (meta.get("version") != version, "meta.json names another version"),
        (meta.get("n_docs") != n, "meta.json and doc_ids.json disagree on the size"),
        (emb.ndim != 2 or emb.dtype != np.float32 or emb.shape[0] != n, "embeddings.npy shape"),
        (cpu.ntotal != n or cpu.d != (emb.shape[1] if emb.ndim == 2 else -1), "index.faiss size"),
        (expected_ids is not None and list(expected_ids) != doc_ids, "doc_ids.json ≠ corpus"),
    ]
    for bad, what in problems:
        if bad:
            raise ArtifactError(path, f"inconsistent ({what})", kind=KIND)
    if n and not np.array_equal(cpu.reconstruct_n(0, n), emb):
        raise ArtifactError(path, "index.faiss ≠ embeddings.npy", kind=KIND)


def load_index(
    var_dir: Path,
    version: str,
    use_gpu: bool = False,
    expected_ids: Sequence[str] | None = None,
) -> DocIndex | None:
    """The saved index of ``version``; None when absent; :class:`ArtifactError` when damaged.

    Sizes are checked on every load, hashes on the first (see :mod:`evaluator.artifacts`); an
    index written before manifests existed is cross-checked, then given a manifest.
    """
    path = Path(var_dir) / INDEX_DIRNAME / version
    if not path.exists():
        return None
    if not (path / "meta.json").is_file():
        raise ArtifactError(path, "incomplete (no meta.json)", kind=KIND)
    legacy = not has_manifest(path)
    if not legacy:
        verify_folder(path, kind=KIND)
    parts = _read(path)
    _check_consistent(path, version, parts, expected_ids)
    if legacy:
        try:
            write_manifest(path)
        except OSError:  # read-only var/: checked again next time
            pass
    _, doc_ids, emb, cpu = parts
    return DocIndex.from_embeddings(version, doc_ids, emb, use_gpu, cpu=cpu)


def _load_or_none(
    path: Path, version: str, use_gpu: bool, expected_ids: Sequence[str], warn: bool
) -> DocIndex | None:
    try:
        return load_index(path.parent.parent, version, use_gpu, expected_ids)
    except ArtifactError as exc:
        if warn:
            log.warning("index %s is damaged (%s): rebuilding it", path, exc.problem)
        return None


def build_or_load(
    documents: Sequence[Document],
    embedder: Embedder,
    var_dir: Path,
    progress_factory: Callable[[int], AbstractContextManager[Callable[[int], None] | None]]
    | None = None,
    use_gpu: bool = False,
) -> tuple[DocIndex, bool]:
    """Return (index, built_now). Embeds the corpus only if no sound index of this version exists.

    A damaged or incomplete index is rebuilt (with a warning). The build holds a file lock: a
    second process waits for it, then loads what the first one wrote. ``progress_factory(n_docs)``
    is entered only for a real build and yields ``advance(n)``.
    """
    version = index_version(documents, embedder.version)
    path = Path(var_dir) / INDEX_DIRNAME / version
    doc_ids = [d.doc_id for d in documents]
    found = _load_or_none(path, version, use_gpu, doc_ids, warn=False)
    if found is not None:
        return found, False
    with build_lock(path, f"index {version}"):
        found = _load_or_none(path, version, use_gpu, doc_ids, warn=True)
        if found is not None:
            return found, False
        for stale in path.parent.glob(f"{TMP_PREFIX}{version}-*"):  # crashed earlier builds
            shutil.rmtree(stale, ignore_errors=True)
        ctx = progress_factory(len(documents)) if progress_factory else nullcontext(None)
        with ctx as advance:
            emb = embedder.encode([d.retrieval_text for d in documents], progress=advance)
        meta = {"n_docs": len(doc_ids), "embedder_version": embedder.version, "kind": "IndexFlatIP"}
        _save(path, version, doc_ids, emb, meta)
    return DocIndex.from_embeddings(version, doc_ids, emb, use_gpu), True
