"""Which queries train, which choose hyperparameters, which report: one definition.

TRAIN split = training queries; TEST split = only for reporting. Hyperparameters are chosen on
the **validation** queries (`val`): the dataset's own DEV split where it ships one
(``qrels/dev.tsv``, e.g. NFCorpus; then every TRAIN query trains, and ``dev`` names the same
queries), else a fixed slice of TRAIN (the LAST `VAL_QUERIES` judged train queries in file
order, never trained on, also excluded from the warm start; SciFact). `casi eval --split val`
evaluates on them.
"""

from __future__ import annotations

from pathlib import Path

from evaluator.corpus import Dataset

VAL_QUERIES = 100
"""Size of the validation slice carved from the end of the TRAIN split (of 809 judged claims)
when the dataset ships no DEV split."""

SPLITS = ("train", "val", "dev", "test")


def has_dev(dataset: Dataset) -> bool:
    """Whether the dataset folder ships a DEV split (``qrels/dev.tsv``), loaded or not."""
    return (dataset.path / "qrels" / "dev.tsv").is_file()


def check_split(split: str, dataset_path: Path) -> None:
    """Refuse a split the dataset folder cannot serve before any work (index, model) starts:
    an unknown name, or ``dev`` where the folder ships no ``qrels/dev.tsv``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
    if split == "dev" and not (Path(dataset_path) / "qrels" / "dev.tsv").is_file():
        raise ValueError(
            f"the dataset {str(dataset_path)!r} ships no DEV split (qrels/dev.tsv): "
            "use --split val, its validation slice of TRAIN"
        )


def train_val_ids(dataset: Dataset, val_size: int = VAL_QUERIES) -> tuple[list[str], list[str]]:
    """(training query ids, validation query ids), disjoint, file order: all of TRAIN and DEV
    where the dataset ships DEV (its ids when DEV is loaded, else none: a caller that only
    trains need not load it), else TRAIN split into its head and a validation slice."""
    ids = dataset.split_query_ids("train")
    if has_dev(dataset):
        return ids, list(dataset.qrels.get("dev", {}))
    n_val = min(val_size, len(ids) // 4)  # a small dataset keeps most of its queries for training
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]


def split_ids(dataset: Dataset, split: str) -> list[str]:
    """Query ids of ``split``: train (minus a validation slice), val, dev (where shipped) or
    test."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
    if split in ("test", "dev") or split == "val" and has_dev(dataset):
        return dataset.split_query_ids(qrels_split(split, dataset))  # DatasetError if missing
    train, val = train_val_ids(dataset)
    return train if split == "train" else val


def qrels_split(split: str, dataset: Dataset) -> str:
    """The qrels file a split's judgments come from (val: dev.tsv where shipped, else
    train.tsv)."""
    if split in ("test", "dev", "train"):
        return split
    return "dev" if has_dev(dataset) else "train"
