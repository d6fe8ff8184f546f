"""Fixtures of the adapter tests: the fixed batch of `fixed_batch.py`."""

from __future__ import annotations

from typing import Any

import pytest
from fixed_batch import B, G, answers


@pytest.fixture(scope="session")
def fixed_batch(smol_tokenizer: Any, slice_dataset: Any) -> dict[str, Any]:
    """query ids / texts per completion (group-major) and the completions' token ids (+ EOS)."""
    qids = slice_dataset.split_query_ids("train")[:B]
    texts = [slice_dataset.queries[q] for q in qids]
    eos = smol_tokenizer.eos_token_id
    ids = [
        list(smol_tokenizer(a, add_special_tokens=False)["input_ids"]) + [eos]
        for a in answers(texts)
    ]
    return {
        "query_ids": [q for q in qids for _ in range(G)],
        "queries": [t for t in texts for _ in range(G)],
        "completion_ids": ids,
    }
