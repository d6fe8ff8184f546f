"""Load a BEIR-style dataset folder: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``.

Read first: :func:`load_dataset`. Every malformed input raises :class:`DatasetError` naming
the file and the 1-based line, so a user can fix the data instead of reading a traceback.

Any BEIR folder loads, including those that ship only some splits (ArguAna, TREC-COVID,
SciDocs, Touché ship only ``qrels/test.tsv``): by default every ``qrels/*.tsv`` present is
loaded, and only code that needs a split asks for it (:meth:`Dataset.check_split` names the
missing file, or the file of a split without a single positive judgment). Relevance grades are
kept as they are (graded qrels: gains 2^g − 1 in nDCG); a (query, document) pair judged twice
in one file is an error, not resolved by row order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """Bad dataset input: ``what`` went wrong, ``where`` (``file:line``) when known."""

    def __init__(self, what: str, where: str | Path | None = None) -> None:
        self.what, self.where = what, None if where is None else str(where)
        super().__init__(f"{self.where}: {what}" if self.where else what)


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str

    @property
    def retrieval_text(self) -> str:
        """What the embedder sees: title + " " + text (BEIR convention)."""
        return f"{self.title} {self.text}".strip()


@dataclass
class Dataset:
    """An in-memory BEIR dataset. ``doc_ids`` fixes the row order used by the index."""

    path: Path
    documents: list[Document]
    queries: dict[str, str]
    qrels: dict[str, dict[str, dict[str, int]]] = field(
        default_factory=dict
    )  # split → qid → did → rel

    def __post_init__(self) -> None:
        self.doc_ids = [d.doc_id for d in self.documents]
        self.row_of = {d: i for i, d in enumerate(self.doc_ids)}

    def split_query_ids(self, split: str) -> list[str]:
        """Judged query ids of a split, in file order."""
        self.check_split(split)
        return list(self.qrels[split])

    def check_split(self, split: str) -> None:
        """DatasetError naming ``qrels/<split>.tsv`` unless that split is loaded and has at
        least one positive judgment (score > 0: nothing to evaluate or train on otherwise)."""
        file = self.path / "qrels" / f"{split}.tsv"
        if split not in self.qrels:
            why = "file not found" if not file.is_file() else "not loaded"
            available = ", ".join(sorted(self.qrels)) or "none"
            raise DatasetError(
                f"the {split} split is needed here but its qrels are missing ({why}); "
                f"splits available: {available}",
                file,
            )
        if not self.qrels[split]:
            raise DatasetError(
                f"the {split} split has no positive judgments (no line with a score > 0)", file
            )

    def qrels_rows(self, split: str) -> dict[str, dict[int, int]]:
        """Qrels of a split keyed by index row (documents outside the corpus slice dropped)."""
        self.check_split(split)
        out: dict[str, dict[int, int]] = {}
        for qid, rels in self.qrels[split].items():
            out[qid] = {self.row_of[d]: r for d, r in rels.items() if d in self.row_of}
        return out


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of a UTF-8 file; bad bytes name the line and column."""
    if not path.is_file():
        raise DatasetError("file not found", path)
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                byte = raw[exc.start]
                raise DatasetError(
                    f"not valid UTF-8 (byte 0x{byte:02x} at column {exc.start + 1})",
                    f"{path}:{lineno}",
                ) from None


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"malformed JSON ({exc.msg})", f"{path}:{lineno}") from None
        if not isinstance(obj, dict) or "_id" not in obj:
            raise DatasetError("expected an object with an '_id' field", f"{path}:{lineno}")
        yield lineno, obj


def load_corpus(path: Path) -> list[Document]:
    docs: list[Document] = []
    seen: set[str] = set()
    for lineno, obj in _jsonl(path):
        doc_id = str(obj["_id"])
        if doc_id in seen:
            raise DatasetError(f"duplicate document id {doc_id!r}", f"{path}:{lineno}")
        title, text = obj.get("title", ""), obj.get("text", "")
        if not isinstance(title, str) or not isinstance(text, str):
            raise DatasetError("'title' and 'text' must be strings", f"{path}:{lineno}")
        seen.add(doc_id)
        docs.append(Document(doc_id, title, text))
    if not docs:
        raise DatasetError("corpus is empty (no documents)", path)
    return docs


def load_queries(path: Path) -> dict[str, str]:
    queries: dict[str, str] = {}
    for lineno, obj in _jsonl(path):
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            raise DatasetError("query needs a non-empty 'text'", f"{path}:{lineno}")
        qid = str(obj["_id"])
        if qid in queries:
            raise DatasetError(f"duplicate query id {qid!r}", f"{path}:{lineno}")
        queries[qid] = text
    if not queries:
        raise DatasetError("no queries", path)
    return queries


def load_qrels(path: Path, queries: dict[str, str], doc_ids: set[str]) -> dict[str, dict[str, int]]:
    """Parse ``query-id<TAB>corpus-id<TAB>score`` (header optional); unknown ids and a
    (query, document) pair judged twice are errors. Only positive scores are kept."""
    qrels: dict[str, dict[str, int]] = {}
    first_line: dict[tuple[str, str], int] = {}  # (query, document) → line of its judgment
    for lineno, line in _lines(path):
        parts = line.rstrip("\r\n").split("\t")
        if not line.strip() or (lineno == 1 and parts[0] == "query-id"):
            continue
        if len(parts) != 3:
            raise DatasetError(
                f"expected 3 tab-separated fields, got {len(parts)}", f"{path}:{lineno}"
            )
        qid, did, score = parts
        try:
            rel = int(score)
        except ValueError:
            raise DatasetError(f"score {score!r} is not an integer", f"{path}:{lineno}") from None
        if qid not in queries:
            raise DatasetError(f"unknown query id {qid!r}", f"{path}:{lineno}")
        if did not in doc_ids:
            raise DatasetError(f"unknown document id {did!r}", f"{path}:{lineno}")
        seen = first_line.setdefault((qid, did), lineno)
        if seen != lineno:
            raise DatasetError(
                f"query {qid!r} and document {did!r} are judged again (first at line {seen})",
                f"{path}:{lineno}",
            )
        if rel > 0:
            qrels.setdefault(qid, {})[did] = rel
    return qrels


def available_splits(path: str | Path) -> list[str]:
    """The splits a BEIR folder ships: the stems of ``qrels/*.tsv``, sorted."""
    return sorted(p.stem for p in (Path(path) / "qrels").glob("*.tsv") if p.is_file())


def load_dataset(
    path: str | Path, splits: tuple[str, ...] | None = None, max_docs: int | None = None
) -> Dataset:
    """Load a BEIR folder, validating that every judgment points at known ids.

    ``splits``: the qrels to load; None (default) = every ``qrels/*.tsv`` present (none is
    fine: a corpus without judgments can still be indexed). A split named here must exist.

    ``max_docs`` makes a *slice*: the first N documents in file order **plus every document
    judged relevant in the loaded splits** (so a small, fast index still contains the answers
    and nDCG stays meaningful; it is an easier collection than the full one — say so when
    reporting numbers on a slice).
    """
    root = Path(path)
    if not root.is_dir():
        raise DatasetError("dataset folder not found", root)
    if max_docs is not None and max_docs < 1:
        raise DatasetError(f"max_docs must be >= 1, got {max_docs}")
    documents = load_corpus(root / "corpus.jsonl")
    queries = load_queries(root / "queries.jsonl")
    ids = {d.doc_id for d in documents}
    wanted = available_splits(root) if splits is None else list(splits)
    qrels = {s: load_qrels(root / "qrels" / f"{s}.tsv", queries, ids) for s in wanted}
    if max_docs is not None:
        judged = {d for split in qrels.values() for rels in split.values() for d in rels}
        documents = [d for i, d in enumerate(documents) if i < max_docs or d.doc_id in judged]
    return Dataset(root, documents, queries, qrels)
