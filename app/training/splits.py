"""Which queries train, which choose hyperparameters, which report: one definition.

TRAIN split = training queries + a fixed validation slice (the LAST `VAL_QUERIES` judged train
queries in file order, never trained on, also excluded from the warm start); TEST split = only
for reporting. `casi eval --split val` evaluates on the validation slice.
"""

from __future__ import annotations

from evaluator.corpus import Dataset

VAL_QUERIES = 100
"""Size of the validation slice carved from the end of the TRAIN split (of 809 judged claims)."""

SPLITS = ("train", "val", "test")


def train_val_ids(dataset: Dataset, val_size: int = VAL_QUERIES) -> tuple[list[str], list[str]]:
    """(training query ids, validation query ids) of the TRAIN split, disjoint, file order."""
    ids = dataset.split_query_ids("train")
    n_val = min(val_size, len(ids) // 4)  # a small dataset keeps most of its queries for training
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]


def split_ids(dataset: Dataset, split: str) -> list[str]:
    """Query ids of ``split``: train (minus the validation slice), val, or test."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
    if split == "test":
        return dataset.split_query_ids("test")
    train, val = train_val_ids(dataset)
    return train if split == "train" else val


def qrels_split(split: str) -> str:
    """The qrels file a split's judgments come from (val lives in train.tsv)."""
    return "test" if split == "test" else "train"
