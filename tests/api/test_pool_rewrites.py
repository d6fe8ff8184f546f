"""Issue 37: the pooled game is a product mode. A real server (`casi serve`, BM25 over a slice
of NFCorpus, CASI_GAME=pool, real Redis and SQLite) returns each query's pool from
`POST /v1/rewrites` (every candidate once, in the fused order, with the rewrites that found it
and the query's own mark) and records who found what with `POST /v1/credits`. Every expected
value is computed here, independently, from the executor's own lists (the same index and
cache, in-process): the pool is their union, found_by is which lists hold a document, the
counts and φ are set sums (φ_j = Σ_{d ∈ L_j ∖ L_0} g(d) / n_d / G). The list game's responses
keep their shape (no `pool` key)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from api_support import auth

from app.runtime import Retrieval, build_retrieval
from app.schemas import RewriteItem, RewriteOut, RewriteResponse
from app.services.rewrite import attach_results
from app.settings import Settings
from tests.pool_support import doc_lists, opening_rewrites

pytestmark = pytest.mark.integration

RETRIEVAL_K = 5
GAME = {"game": "pool", "retriever": "bm25", "bm25_stemmer": "none", "retrieval_k": RETRIEVAL_K}
ITEM_KEYS = {"query", "rewrites", "status", "finish_reason", "n_tokens", "results", "merged"}
SERVER_ENV = {f"CASI_{k.upper()}": str(v) for k, v in GAME.items()}  # the `server` fixture's


def _retrieval(var: Path, dataset: Path, redis_url: str, **game: Any) -> Retrieval:
    settings = Settings(var_dir=var, dataset=dataset, REDIS_URL=redis_url, device="cpu", **game)
    return build_retrieval(settings)


@pytest.fixture(scope="module")
def pool_retrieval(api_var: Path, nf_slice: Path, redis_url: str) -> Retrieval:
    """The server's index and cache, in-process, built before the server starts (BM25, and the
    MiniLM index its cosine evaluator reads), so that the server only loads them."""
    retrieval = _retrieval(api_var, nf_slice, redis_url, **GAME)
    assert retrieval.executor.merge == "pool"
    retrieval.dense_index()
    return retrieval


UNJUDGED = {"_id": "PLAIN-314", "text": "Foie gras ban in California: human health implications"}
TWIN = "TWIN-1"  # a second id with the text of the slice's first TRAIN query, and no judgments


@pytest.fixture(scope="module")
def slice_path(pool_retrieval: Retrieval, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `server` fixture (tests/api/conftest.py) serves this module's NFCorpus slice (every
    NFCorpus query, the judgments of a few; PLAIN-314 has none anywhere), with a second id for
    a judged query's text, as NFCorpus has for 21 texts."""
    ds = pool_retrieval.dataset
    assert ds.queries[UNJUDGED["_id"]] == UNJUDGED["text"]
    src, dst = Path(ds.path), tmp_path_factory.mktemp("nfcorpus-slice-twin")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    twin = {"_id": TWIN, "text": ds.queries[ds.split_query_ids("train")[0]]}
    with (dst / "queries.jsonl").open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(twin) + "\n")
    return dst


def _expected_pool(lists: list[list[str]], query: list[str]) -> dict[str, tuple[list[int], bool]]:
    """Every document of the query's and the rewrites' lists → (found_by, in the query's list)."""
    docs = {d for own in [*lists, query] for d in own}
    return {d: ([j for j, own in enumerate(lists) if d in own], d in query) for d in docs}


def _check_pool(item: dict[str, Any], retrieval: Retrieval) -> None:
    texts = ["" if rw["degenerate"] else rw["text"] for rw in item["rewrites"]]  # as played
    lists = doc_lists(retrieval, texts)
    query = doc_lists(retrieval, [item["query"]])[0]
    expected = _expected_pool(lists, query)
    pool = item["pool"]
    assert [d["id"] for d in pool] == [d["id"] for d in item["merged"]]  # the served order
    assert len(pool) == len(expected) and {d["id"] for d in pool} == set(expected)  # once each
    # served in the second stage's order (evaluator.rerank: BM25 of query + rewrites' words)
    reranker = retrieval.reranker()
    assert reranker is not None
    row_of = {d.doc_id: i for i, d in enumerate(retrieval.dataset.documents)}
    ranked, scores = reranker.rerank(
        [item["query"]], [texts], np.array([sorted(row_of[d] for d in expected)])
    )
    ids = retrieval.executor.retriever.doc_ids
    assert [d["id"] for d in item["merged"]] == [ids[int(r)] for r in ranked[0] if r >= 0]
    assert [d["score"] for d in item["merged"]] == pytest.approx(
        [float(s) for s in scores[0][ranked[0] >= 0]], abs=1e-6
    )
    for d in pool:
        assert (d["found_by"], d["query"]) == expected[d["id"]], d["id"]
    assert [[d["id"] for d in docs] for docs in item["results"]] == lists
    assert sum(d["query"] for d in pool) == len(query) > 0


def test_rewrites_return_the_pool_with_who_found_each_candidate(
    client: httpx.Client, keys: dict[str, str], pool_retrieval: Retrieval
) -> None:
    ds = pool_retrieval.dataset
    queries = [ds.queries[q] for q in ds.split_query_ids("train")[:2]]
    body = {"queries": queries, "n_actions": 3, "include_results": True}
    r = client.post("/v1/rewrites", json=body, headers=auth(keys["user"]))
    assert r.status_code == 200, r.text
    for query, item in zip(queries, r.json()["items"], strict=True):
        assert item["query"] == query and len(item["rewrites"]) == 3
        _check_pool(item, pool_retrieval)
    # without include_results there is nothing to pool: the field is absent
    plain = client.post(
        "/v1/rewrites", json={**body, "include_results": False}, headers=auth(keys["user"])
    )
    assert plain.status_code == 200 and all("pool" not in it for it in plain.json()["items"])
    ready = client.get("/readyz").json()
    assert "bm25 retrieval, game pool (merge pool, k 5)" in ready["components"]["index"]["detail"]


def _items(query: str, rewrites: list[str]) -> list[RewriteItem]:
    outs = [RewriteOut(text=t, token_start=0, token_end=1) for t in rewrites]
    return [RewriteItem(query=query, rewrites=outs, status="ok", finish_reason="stop", n_tokens=1)]


def test_copies_of_a_rewrite_hold_the_same_candidates_and_the_list_game_has_no_pool(
    pool_retrieval: Retrieval, api_var: Path, nf_slice: Path, redis_url: str
) -> None:
    qid, rewrites = opening_rewrites(pool_retrieval.dataset)
    query = pool_retrieval.dataset.queries[qid]
    items = _items(query, rewrites)
    attach_results(pool_retrieval, items, 10)
    item = items[0].model_dump(mode="json")
    _check_pool(item, pool_retrieval)
    by_copy = [{d["id"] for d in item["pool"] if j in d["found_by"]} for j in (0, 1)]
    assert by_copy[0] == by_copy[1] != set()  # the two copies found the same documents
    assert all((0 in d["found_by"]) == (1 in d["found_by"]) for d in item["pool"])
    # the list game (bm25 → rrf, cut to K): no pool, the item's JSON keeps its keys
    listed = _retrieval(api_var, nf_slice, redis_url, **{**GAME, "game": "list"})
    assert listed.executor.merge == "rrf"
    items = _items(query, rewrites)
    attach_results(listed, items, 10)
    response = RewriteResponse(policy_version="p", items=items, batch_rows=1, queue_wait_ms=0.0)
    dumped = response.model_dump(mode="json")["items"][0]
    assert set(dumped) == ITEM_KEYS and len(dumped["merged"]) == 10
    assert '"pool"' not in response.model_dump_json()


def test_a_degenerate_rewrite_is_served_as_an_empty_action(pool_retrieval: Retrieval) -> None:
    """A string of repeats (evaluator.text.degenerate) is flagged and played as training's
    refuse_degenerate plays it: its own list is empty, no candidate names it, and its words do
    not reach the second stage (the pool is served as with an empty rewrite in its place)."""
    qid, rewrites = opening_rewrites(pool_retrieval.dataset)
    query = pool_retrieval.dataset.queries[qid]
    repeats = " ".join([query.split()[0].lower()] * 3)  # the query's first word three times
    assert doc_lists(pool_retrieval, [repeats])[0], "as written, it would find documents"
    items = _items(query, [rewrites[0], repeats])
    attach_results(pool_retrieval, items, 10)
    item = items[0].model_dump(mode="json")
    assert [rw["degenerate"] for rw in item["rewrites"]] == [False, True]
    assert item["results"][1] == [] and all(1 not in d["found_by"] for d in item["pool"])
    _check_pool(item, pool_retrieval)  # the pool and its served order with "" in its place
    blank = _items(query, [rewrites[0], ""])
    attach_results(pool_retrieval, blank, 10)
    assert item["merged"] == blank[0].model_dump(mode="json")["merged"]


def test_credits_record_who_found_what_in_the_pooled_game(
    client: httpx.Client, keys: dict[str, str], pool_retrieval: Retrieval
) -> None:
    qid, rewrites = opening_rewrites(pool_retrieval.dataset)
    ds = pool_retrieval.dataset
    body = {"query_id": qid, "rewrites": rewrites}
    r = client.post("/v1/credits", json=body, headers=auth(keys["user"]))
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["game"] == "pool" and out["merge"] == "pool"
    lists = doc_lists(pool_retrieval, rewrites)
    query = set(doc_lists(pool_retrieval, [ds.queries[qid]])[0])
    new = [set(own) - query for own in lists]
    only = [{d for d in new[j] if all(d not in lists[i] for i in range(4) if i != j)}
            for j in range(4)]  # fmt: skip
    pool = query.union(*lists)
    assert out["pool"] == {"anchor": len(query), "size": len(pool),
                           "new": [len(s) for s in new], "only": [len(s) for s in only]}  # fmt: skip
    assert out["pool"]["new"][0] == out["pool"]["new"][1] > 0 and out["pool"]["only"][:2] == [0, 0]
    # the value is graded recall of the pool; φ splits each new document among its finders
    grades = ds.qrels["train"][qid]
    total = sum(grades.values())
    assert out["value_full"] == pytest.approx(
        sum(grades.get(d, 0) for d in pool) / total, abs=1e-12
    )
    assert out["value_empty"] == pytest.approx(
        sum(grades.get(d, 0) for d in query) / total, abs=1e-12
    )
    n_found = {d: sum(d in own for own in lists) for d in pool}
    phi = [sum(grades.get(d, 0) / n_found[d] for d in new[j]) / total for j in range(4)]
    assert out["phi"] == pytest.approx(phi, abs=1e-12)
    assert out["phi"][0] == pytest.approx(out["phi"][1], abs=1e-12)  # copies split it equally
    again = client.get(f"/v1/credits/{out['id']}", headers=auth(keys["user"]))
    assert again.status_code == 200
    assert {k: again.json()[k] for k in ("game", "merge", "pool")} == {
        k: out[k] for k in ("game", "merge", "pool")
    }


def test_credits_name_the_query_they_cannot_score_instead_of_failing(
    client: httpx.Client, keys: dict[str, str], pool_retrieval: Retrieval
) -> None:
    """A query the replay evaluator cannot score (no judgments) is a 404 naming the field, by
    id or by text; a text two dataset queries share is resolved to the judged one under replay
    and refused (409: it clashes with the dataset, the request itself is well-formed) where both
    could be scored; query and query_id that disagree are a 409 too.
    Never a 500."""
    judged = pool_retrieval.dataset.split_query_ids("train")[0]
    text = pool_retrieval.dataset.queries[judged]

    def post(body: dict[str, Any]) -> httpx.Response:
        return client.post("/v1/credits", json={**body, "rewrites": ["statins", "diet"]},
                           headers=auth(keys["user"]))  # fmt: skip

    for body, field in (({"query_id": UNJUDGED["_id"]}, "body.query_id"),
                        ({"query": UNJUDGED["text"]}, "body.query"),
                        ({"query_id": TWIN}, "body.query_id")):  # fmt: skip
        r = post(body)
        assert r.status_code == 404, r.text
        assert r.json()["field"] == field and "has no relevance judgments" in r.json()["message"]
    r = post({"query": UNJUDGED["text"], "evaluator": "cosine"})  # cosine needs no judgments
    assert r.status_code == 201 and r.json()["query_id"] == UNJUDGED["_id"], r.text
    r = post({"query": text})  # replay: only one of the two ids is judged
    assert r.status_code == 201 and r.json()["query_id"] == judged, r.text
    r = post({"query": text, "evaluator": "cosine"})
    assert r.status_code == 409 and r.json()["field"] == "body.query", r.text
    assert f"is the text of 2 dataset queries ({judged}, {TWIN})" in r.json()["message"]
    r = post({"query_id": judged, "query": "another text"})
    assert r.status_code == 409 and r.json()["field"] == "body.query", r.text
    assert f"differs from the text of query {judged!r}" in r.json()["message"]
    assert post({"query_id": judged, "query": f"  {text} "}).status_code == 201  # alike
