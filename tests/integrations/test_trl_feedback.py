"""The adapters read the feedback context from the same builder as `casi train`: a CasiCredit
built from a BEIR folder carries its game's FeedbackContext, and `casi_dataset` with the
``feedback`` prompt writes the prompts the trainer would (NFCorpus slice, pooled game, BM25)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.runtime import build_retrieval
from app.settings import Settings
from app.training.splits import split_ids
from casi_integrations.credit import CasiCredit
from casi_integrations.trl import casi_dataset
from policy.prompts import build_prompt_text

GAME = {"CASI_GAME": "pool", "CASI_RETRIEVER": "bm25", "CASI_BM25_STEMMER": "none",
        "CASI_RETRIEVAL_K": "5"}  # fmt: skip


def test_casi_dataset_prompts_with_the_trainers_feedback_context(
    nf_slice: Path, tmp_path: Path, smol_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in GAME.items():
        monkeypatch.setenv(name, value)
    casi = CasiCredit.from_beir(nf_slice, smol_tokenizer, n_actions=2, var_dir=tmp_path)
    assert casi.feedback is not None
    ds = casi_dataset(
        _dataset(nf_slice), "train", smol_tokenizer, 2,
        prompt_style="feedback", feedback=casi.feedback, feedback_words=8, limit=3,
    )  # fmt: skip
    settings = Settings(
        var_dir=tmp_path, dataset=nf_slice, **{k.lower()[5:]: v for k, v in GAME.items()}
    )
    r = build_retrieval(settings)  # the trainer's retrieval of the same game
    ids = split_ids(r.dataset, "train")[:3]
    texts = [r.dataset.queries[q] for q in ids]
    want = [
        build_prompt_text(smol_tokenizer, t, 2, "feedback", c)
        for t, c in zip(texts, r.feedback().contexts(texts, 8, 2), strict=True)
    ]
    assert ds["prompt"] == want and ds["query_id"] == ids
    with pytest.raises(ValueError, match="needs feedback="):
        casi_dataset(_dataset(nf_slice), "train", smol_tokenizer, 2, prompt_style="feedback")


def _dataset(folder: Path) -> Any:
    from evaluator.corpus import load_dataset

    return load_dataset(folder)
