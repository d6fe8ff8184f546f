"""FAISS index over the frozen embeddings of a corpus, versioned by content hash.

Read first: :func:`build_or_load`. The version is a hash of (document ids + texts, embedder
version); the index lives in ``<var>/index/<version>/`` and is rebuilt only when one of those
inputs changes. Rows of the index are the integer document ids used everywhere downstream.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from evaluator.corpus import Document
from evaluator.embed import Embedder

INDEX_DIRNAME = "index"


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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    np.save(tmp / "embeddings.npy", emb)
    (tmp / "doc_ids.json").write_text(json.dumps(doc_ids))
    (tmp / "meta.json").write_text(json.dumps({"version": version, **meta}, indent=2))
    flat = faiss.IndexFlatIP(emb.shape[1])
    flat.add(np.ascontiguousarray(emb, dtype=np.float32))
    faiss.write_index(flat, str(tmp / "index.faiss"))
    os.replace(tmp, path)  # atomic: a half-written index is never picked up


def load_index(var_dir: Path, version: str, use_gpu: bool = False) -> DocIndex | None:
    path = Path(var_dir) / INDEX_DIRNAME / version
    if not (path / "meta.json").is_file():
        return None
    emb = np.load(path / "embeddings.npy")
    doc_ids = json.loads((path / "doc_ids.json").read_text())
    cpu = faiss.read_index(str(path / "index.faiss"))
    return DocIndex.from_embeddings(version, doc_ids, emb, use_gpu, cpu=cpu)


def build_or_load(
    documents: Sequence[Document],
    embedder: Embedder,
    var_dir: Path,
    progress_factory: Callable[[int], AbstractContextManager[Callable[[int], None] | None]]
    | None = None,
    use_gpu: bool = False,
) -> tuple[DocIndex, bool]:
    """Return (index, built_now). Embeds the corpus only if no index of this version exists.

    ``progress_factory(n_docs)`` is entered only for a real build and yields ``advance(n)``.
    """
    version = index_version(documents, embedder.version)
    found = load_index(var_dir, version, use_gpu)
    if found is not None:
        return found, False
    ctx = progress_factory(len(documents)) if progress_factory else nullcontext(None)
    with ctx as advance:
        emb = embedder.encode([d.retrieval_text for d in documents], progress=advance)
    doc_ids = [d.doc_id for d in documents]
    meta = {"n_docs": len(doc_ids), "embedder_version": embedder.version, "kind": "IndexFlatIP"}
    _save(Path(var_dir) / INDEX_DIRNAME / version, version, doc_ids, emb, meta)
    return DocIndex.from_embeddings(version, doc_ids, emb, use_gpu), True
