"""BM25 retrieval actions: tokenization, retrieval, versions, the registry, the executor and the
credit path on a real slice of SciFact with real Redis (nothing mocked)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from evaluator.actions import ActionExecutor
from evaluator.bm25 import BM25Params, bm25_version, build_or_load_bm25, tokenize
from evaluator.cache import ActionCache
from evaluator.corpus import Document
from evaluator.credit import RolloutActions, compute_credits
from evaluator.retrievers import (
    DenseRetriever,
    RetrieverSpec,
    build_retriever,
    default_merge,
    register_retriever,
    registered_retrievers,
)
from evaluator.scorers import make_scorer

DOCS = [
    Document("a", "Cats", "the cat sat on the mat"),
    Document("b", "Dogs", "dogs chase cats and cats run"),
    Document("c", "Birds", "a bird in the hand"),
    Document("d", "Mixed", "cats dogs birds"),
]


def test_tokenization_lowercases_drops_stopwords_and_short_tokens_without_stemming() -> None:
    assert tokenize(["The Cats, a dog and I!"], BM25Params()) == [["cats", "dog"]]
    assert tokenize(["the and of"], BM25Params()) == [[]]


def test_retrieve_pads_non_matching_documents_and_ranks_ties_by_row(tmp_path: Path) -> None:
    index, built = build_or_load_bm25(DOCS, tmp_path)
    assert built and index.name == "bm25" and len(index) == 4
    rows, scores = index.retrieve(["cats", "zebra", "", "birds bird"], 3)
    assert rows.shape == (4, 3) and rows.dtype == np.int64 and scores.dtype == np.float32
    assert set(rows[0][rows[0] >= 0].tolist()) == {0, 1, 3} and rows[0, 0] == 1  # "cats" ×3
    assert (np.diff(scores[0]) <= 0).all()
    assert rows[1].tolist() == [-1, -1, -1] and np.isneginf(scores[1]).all()  # no shared token
    assert rows[2].tolist() == [-1, -1, -1]  # empty query
    assert 2 in rows[3].tolist() and 3 in rows[3].tolist()  # "bird" ≠ "birds": no stemming
    deeper, _ = index.retrieve(["cats"], 10)  # k beyond the corpus: padded
    assert deeper.shape == (1, 10) and (deeper[0, 4:] == -1).all()


def test_version_changes_with_parameters_and_corpus() -> None:
    base = bm25_version(DOCS, BM25Params())
    assert bm25_version(DOCS, BM25Params()) == base
    assert bm25_version(DOCS, BM25Params(k1=1.2)) != base
    assert bm25_version(DOCS, BM25Params(b=0.5)) != base
    assert bm25_version(DOCS, BM25Params(stopwords="")) != base
    assert bm25_version(DOCS[:3], BM25Params()) != base
    with pytest.raises(ValueError, match="0 <= b <= 1"):
        BM25Params(b=2.0)


def test_rules_2_cut_the_top_k_exactly_and_rules_1_keep_their_versions(tmp_path: Path) -> None:
    """bm25s cuts the top k itself: among documents tied at the cut it kept the largest rows,
    and which ones depended on k (40 identical documents: k = 3 gave rows 42-44, k = 45 began at
    row 5), so the depth-10 list was not the first 10 of the depth-100 list. Rules 2 keep the
    smaller rows; rules 1 (what pre-registered protocols ran under) keep bm25s's cut and hash
    exactly as before the field existed."""
    docs = [Document(f"x{i}", "", "zebra stripes") for i in range(5)]
    docs += [Document(f"p{i}", "", "apple pie") for i in range(40)]  # rows 5..44 tie
    index, _ = build_or_load_bm25(docs, tmp_path)
    assert index.params.rules == 2
    for k in (3, 10, 45):
        rows, _ = index.retrieve(["apple pie"], k)
        assert rows[0].tolist() == [*range(5, 5 + min(k, 40)), *[-1] * max(0, k - 40)]
    legacy, _ = build_or_load_bm25(docs, tmp_path, BM25Params(rules=1))
    rows, scores = legacy.retrieve(["apple pie"], 3)
    assert rows[0].tolist() != [5, 6, 7] and np.isclose(scores[0], scores[0, 0]).all()
    assert index.version != legacy.version
    fields = {"b": 0.75, "k1": 1.5, "lower": True, "method": "lucene", "stemmer": None,
              "stopwords": "english", "token_pattern": r"(?u)\b\w\w+\b"}  # fmt: skip
    assert BM25Params(rules=1).canonical() == json.dumps(fields, sort_keys=True)
    with pytest.raises(ValueError, match=r"rules must be one of \[1, 2\], got 3"):
        BM25Params(rules=3)


def test_rules_2_read_documents_as_rewrites_are_read(tmp_path: Path) -> None:
    """Rewrites are NFKC-normalised (`normalize_rewrite`: µ → μ, ﬁ → fi); documents were
    tokenised as written, so a rewrite copying a document's "µg" or "ﬁbroblast" found nothing."""
    docs = [Document("d0", "", "5 µg of ﬁbroblast growth"), Document("d1", "", "plain words")]
    rows, _ = build_or_load_bm25(docs, tmp_path)[0].retrieve(["μg", "fibroblast"], 2)
    assert rows[:, 0].tolist() == [0, 0]
    legacy, _ = build_or_load_bm25(docs, tmp_path, BM25Params(rules=1))
    assert legacy.retrieve(["μg", "fibroblast"], 2)[0][:, 0].tolist() == [-1, -1]


def test_registry_one_place() -> None:
    assert registered_retrievers() == ("bm25", "dense")
    assert default_merge("dense") == "max" and default_merge("bm25") == "rrf"
    with pytest.raises(ValueError, match="unknown retriever 'splade'; valid: bm25, dense"):
        build_retriever("splade", RetrieverSpec(DOCS, Path(".")))
    with pytest.raises(ValueError, match="already registered"):
        register_retriever("bm25", default_merge="rrf")(lambda spec: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="unknown merge rule"):
        register_retriever("other", default_merge="min")


def _bm25_executor(slice_dataset, var_dir, redis_client, k: int = 10) -> ActionExecutor:  # type: ignore[no-untyped-def]
    spec = RetrieverSpec(slice_dataset.documents, var_dir)
    retriever, _ = build_retriever("bm25", spec)
    cache = ActionCache(redis_client, retriever.version, retriever.encoder_version, k)
    return ActionExecutor(None, retriever, cache)


def test_executor_runs_bm25_through_the_cache(slice_dataset, var_dir, redis_client) -> None:  # type: ignore[no-untyped-def]
    ex = _bm25_executor(slice_dataset, var_dir, redis_client)
    assert ex.merge == "rrf" and ex.rrf_k == 60.0
    texts = ["vitamin D deficiency", "BRCA1 mutation cancer risk", "", "vitamin D deficiency"]
    first = ex.run(texts)
    assert first.stats["misses"] == 2 and not first.from_cache.any()
    second = ex.run(texts)
    assert second.stats["hits"] == 2 and second.from_cache[[0, 1, 3]].all()
    np.testing.assert_array_equal(first.rows, second.rows)
    np.testing.assert_array_equal(first.scores, second.scores)
    assert (first.rows[2] == -1).all()  # the empty rewrite is a null player
    direct, _ = ex.retriever.retrieve(["vitamin d deficiency"], 10)
    np.testing.assert_array_equal(first.rows[0], direct[0])


def test_cache_keys_carry_the_retriever_version(  # type: ignore[no-untyped-def]
    slice_dataset, var_dir, embedder, slice_index, redis_client
) -> None:
    bm25 = _bm25_executor(slice_dataset, var_dir, redis_client)
    dense = DenseRetriever(embedder, slice_index)
    dense_cache = ActionCache(redis_client, dense.version, dense.encoder_version, 10)
    assert bm25.cache.key("x") != dense_cache.key("x")
    assert bm25.retriever.version in bm25.cache.key("x")
    with pytest.raises(ValueError, match="versions in use"):
        ActionExecutor(None, bm25.retriever, dense_cache)


def test_bm25_credit_defaults_to_rrf_and_is_efficient_at_m8(  # type: ignore[no-untyped-def]
    slice_dataset, var_dir, redis_client
) -> None:
    ex = _bm25_executor(slice_dataset, var_dir, redis_client)
    qid = slice_dataset.split_query_ids("test")[0]
    scorer = make_scorer("replay", qrels=slice_dataset.qrels_rows("test"), k=10)
    words = slice_dataset.queries[qid].split()
    actions = [" ".join(words[i : i + 3]) for i in range(0, 3 * 8, 3)][:8]
    actions += [""] * (8 - len(actions))
    res = compute_credits(
        [RolloutActions(qid, slice_dataset.queries[qid], actions)], ex, scorer, 10
    )
    assert res.merge == "rrf" and res.values.shape == (1, 256) and res.phi.shape == (1, 8)
    assert float(res.residual.abs().max()) < 1e-9
    as_max = compute_credits(
        [RolloutActions(qid, slice_dataset.queries[qid], actions)], ex, scorer, 10, merge="max"
    )
    assert as_max.merge == "max"
    assert float(res.value_empty[0]) == float(as_max.value_empty[0])  # ∅ = the query alone


def test_corpus_without_a_single_token_is_refused_by_name(tmp_path: Path) -> None:
    from evaluator.corpus import DatasetError

    empty = [Document("d0", "", "the a"), Document("d1", "I", "of, and!"), Document("d2", "", "")]
    with pytest.raises(DatasetError, match=r"BM25 cannot index the corpus \['d0', 'd1', 'd2'\]"):
        build_or_load_bm25(empty, tmp_path)  # was: ValueError max() arg is an empty sequence
    # one usable token anywhere is enough; documents without tokens are simply never retrieved
    index, built = build_or_load_bm25([*empty, Document("d3", "", "apple")], tmp_path)
    assert built and index.retrieve(["apple", "the"], 2)[0].tolist() == [[3, -1], [-1, -1]]
