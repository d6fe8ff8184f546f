"""The pooled game as a product mode, on a real slice of NFCorpus (BM25, real Redis): the
settings that choose it, the DEV split as the validation queries, the held-out pool numbers
against a brute-force set computation, the keyword-expansion baseline, and the warm start's
document pseudo-rewrites (which never repeat the query; the SciFact recipe is unchanged)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pytest

from app.errors import SettingsError
from app.runtime import build_retrieval
from app.settings import Settings
from app.training.evaluate import build_eval_request
from app.training.splits import qrels_split, split_ids, train_val_ids
from app.training.warmstart import warmstart_examples
from evaluator.corpus import load_dataset
from evaluator.prf import KeywordExpansion
from policy.evaluate import EvalConfig, evaluate_policy
from policy.model import build_tiny_policy
from policy.rollout import RolloutConfig
from policy.warmstart import boilerplate, document_line, document_rewrites
from tests.conftest import NF_SLICE_QUERIES, ROOT

NFCORPUS = ROOT / "data" / "nfcorpus"
PER_SPLIT = NF_SLICE_QUERIES


def test_the_vendored_nfcorpus_matches_its_checksums() -> None:
    for line in (NFCORPUS / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((NFCORPUS / name).read_bytes()).hexdigest() == digest, name


def test_dev_is_the_validation_split_where_a_dataset_ships_it(nf_slice: Path) -> None:
    ds = load_dataset(nf_slice)
    assert split_ids(ds, "val") == split_ids(ds, "dev") == ds.split_query_ids("dev")
    assert train_val_ids(ds)[0] == ds.split_query_ids("train")  # every TRAIN query trains
    assert qrels_split("val", ds) == "dev" and qrels_split("test", ds) == "test"
    scifact = load_dataset(ROOT / "data" / "scifact")
    assert qrels_split("val", scifact) == "train"  # SciFact: a slice of TRAIN
    assert len(split_ids(scifact, "val")) == 100


def test_the_game_settings() -> None:
    pool = Settings(game="pool", retrieval_k=25)
    assert pool.resolved_merge("bm25") == "pool" and pool.scorer_metric() == "graded_recall"
    assert pool.scorer_k() == 13 * 25  # no pool of up to 12 rewrites + the query is ever cut
    listed = Settings()
    assert listed.resolved_merge("bm25") == "rrf" and listed.scorer_k() == listed.list_k
    with pytest.raises(SettingsError, match="CASI_GAME=pool"):
        Settings(game="pool", merge="max")
    with pytest.raises(SettingsError, match="set CASI_GAME=pool"):
        Settings(merge="pool")


def _graded_recall(found: set[int], grades: dict[int, int]) -> float:
    return sum(g for d, g in grades.items() if d in found) / sum(grades.values())


def test_held_out_pool_numbers_equal_a_set_computation(
    nf_slice: Path, tmp_path: Path, smol_tokenizer: Any
) -> None:
    settings = Settings(
        var_dir=tmp_path, dataset=nf_slice, retriever="bm25", bm25_stemmer="none", game="pool",
        retrieval_k=5,
    )  # fmt: skip
    r = build_retrieval(settings)
    assert r.executor.merge == "pool"
    rollout = RolloutConfig(n_actions=2, line_cap=6, prompt="short")
    request = build_eval_request(r, "val", 4, EvalConfig(rollout=rollout, batch_size=4))
    assert request.pool is not None and request.pool.budget_executor.k == 3 * 5
    model = build_tiny_policy(smol_tokenizer, seed=0)
    res = evaluate_policy(
        model, smol_tokenizer, request.queries, request.executor, request.ndcg, request.recall,
        request.config, recall_executor=request.recall_executor, pool=request.pool,
    )  # fmt: skip
    qrels = r.dataset.qrels_rows("dev")
    for (qid, text), row in zip(request.queries, res.per_query, strict=True):
        own = {int(d) for d in r.executor.run([text]).rows[0] if d >= 0}
        found = set(own)
        for rewrite in row["rewrites"]:
            found |= {int(d) for d in r.executor.run([rewrite]).rows[0] if d >= 0}
        assert row["pool"][0] == pytest.approx(_graded_recall(own, qrels[qid]), abs=1e-12)
        assert row["pool"][2] == pytest.approx(_graded_recall(found, qrels[qid]), abs=1e-12)
        deep = {int(d) for d in request.pool.budget_executor.run([text]).rows[0] if d >= 0}
        assert row["budget"] == pytest.approx(_graded_recall(deep, qrels[qid]), abs=1e-12)
        assert 0.0 <= row["overlap"] <= 1.0
    for key in ("combined_pool_recall", "budget_pool_recall", "prf_pool_recall", "overlap"):
        assert 0.0 <= res.metrics[key] <= 1.0
    mean = sum(row["pool"][2] for row in res.per_query) / len(res.per_query)
    assert res.metrics["combined_pool_recall"] == pytest.approx(mean)


def test_keyword_expansion_deals_distinct_words_from_the_top_documents() -> None:
    texts = [
        "statin breast cancer survival cohort statin statin",
        "breast cancer cholesterol cells cholesterol",
        "cohort study cancer registry",
        "unrelated words only here",
    ]
    prf = KeywordExpansion(texts, feedback=3, words=2)
    lines = prf.rewrites([0, 1, 2, 3], n_actions=3)
    words = [w for line in lines for w in line.split()]
    assert len(lines) == 3 and len(words) == len(set(words))  # the rewrites share no word
    assert "statin" in lines[0]  # the best-scored word leads the first rewrite
    assert not {"unrelated", "only", "here"} & set(words)  # only the top 3 documents count


def test_document_pseudo_rewrites_never_repeat_the_query(nf_slice: Path) -> None:
    ds = load_dataset(nf_slice, splits=("train",))
    for source in ("openings", "keywords"):
        examples = warmstart_examples(ds, 4, None, 0, source, 8)
        assert examples and len(examples) <= PER_SPLIT["train"]
        for ex in examples:
            lines = [line.split(". ", 1)[1] for line in ex.answer.splitlines()]
            assert len(lines) == 4 and len(set(lines)) == 4
            assert ex.query.lower() not in lines and all(len(x.split()) <= 8 for x in lines)
            assert not {"num", "abstract", "pubmed", "ncbi"} & set(" ".join(lines).split())
    rng = random.Random(0)
    assert document_rewrites(["alpha beta gamma delta"], 2, rng, "openings", 2) == [
        "alpha beta",
        "gamma delta",
    ]  # fmt: skip  (one document: its next words fill the second line)


def test_boilerplate_words_are_left_out_and_end_the_title() -> None:
    texts = [f"topic{i} words here abstract background num cells pubmed" for i in range(4)]
    noise = boilerplate([*texts, "other text without it"])
    # the words of 4 of the 5 documents (more than half); topic0..3 are in one each
    assert noise == {"words", "here", "abstract", "background", "num", "cells", "pubmed"}
    doc = "statin breast cancer survival cohort pubmed ncbi abstract recent studies statins"
    noise = frozenset({"pubmed", "ncbi", "abstract"})
    assert document_line(doc, "openings", 8, 0, noise) == "statin breast cancer survival cohort"
    assert document_line(doc, "openings", 2, 4, noise) == "cohort recent"  # then the body
    assert document_line("ab abstract rest of it", "openings", 3, 0, noise) == "ab rest"


def test_the_scifact_warm_start_examples_are_unchanged() -> None:
    """The SciFact recipe hashes (d67b684cf777 and its siblings) name these exact examples."""
    ds = load_dataset(ROOT / "data" / "scifact", splits=("train",))
    examples = warmstart_examples(ds, 4, None, 0)
    digest = hashlib.sha256(
        json.dumps([(e.query, e.answer) for e in examples]).encode()
    ).hexdigest()[:16]
    assert digest == SCIFACT_EXAMPLES_SHA


SCIFACT_EXAMPLES_SHA = "bbc305fafeb585fe"  # of the examples before the document sources existed


def test_a_run_resumes_in_the_game_and_dataset_it_started_in(nf_slice: Path) -> None:
    from app.cli.train import retrieval_settings, stored_retrieval

    started = Settings(dataset=nf_slice, game="pool", retriever="bm25", retrieval_k=50)
    meta = json.loads(json.dumps({"retrieval": retrieval_settings(started)}))  # as stored
    now = Settings().model_copy(update=stored_retrieval(meta))  # the environment says list
    assert (now.game, now.dataset, now.retrieval_k) == ("pool", nf_slice, 50)
    assert now.resolved_merge("bm25") == "pool"
    legacy = Settings(game="pool").model_copy(update=stored_retrieval({"retrieval": None}))
    # before any of them existed
    assert (legacy.game, legacy.bm25_stemmer, legacy.bm25_rules) == ("list", "none", 1)
    assert now.bm25_rules == 2  # stored with the run (the default)
