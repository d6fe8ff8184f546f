"""Each endpoint's success path against a real server (tiny policy, SciFact slice, real Redis
and SQLite), with the numbers checked: credits satisfy efficiency and match THE credit path
run in-process on the same inputs; merged lists are the coalition engine's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from api_support import ApiServer, auth
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration


def judged_query(slice_path: Path) -> str:
    return (slice_path / "qrels" / "train.tsv").read_text().splitlines()[1].split("\t")[0]


def test_healthz_readyz_metrics(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    body = ready.json()
    assert body["status"] == "ready" and body["down"] == []
    assert set(body["components"]) == {"database", "redis", "index", "policy"}
    assert all(c["ok"] for c in body["components"].values())
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert "casi_http_request_duration_seconds_bucket" in metrics.text
    assert 'route="/readyz"' in metrics.text


def test_rewrites_with_results(client: httpx.Client, keys: dict[str, str]) -> None:
    queries = ["vitamin D and bone fractures", "aspirin lowers colorectal cancer risk"]
    r = client.post(
        "/v1/rewrites",
        json={
            "queries": queries,
            "n_actions": 3,
            "include_results": True,
            "max_new_tokens": 16,
            "format": "free",
        },
        headers=auth(keys["user"]),
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["policy_version"]) == 12 and body["cache"] in ("ok", "degraded")
    assert body["batch_rows"] >= 2 and body["queue_wait_ms"] >= 0
    for query, item in zip(queries, body["items"], strict=True):
        assert item["query"] == query and item["n_tokens"] <= 16
        assert len(item["rewrites"]) <= 3 and len(item["results"]) == len(item["rewrites"])
        for rw in item["rewrites"]:
            assert 0 <= rw["token_start"] < rw["token_end"] <= item["n_tokens"]
        merged = item["merged"]
        assert 0 < len(merged) <= 10 and len({d["id"] for d in merged}) == len(merged)
        scores = [d["score"] for d in merged]
        assert scores == sorted(scores, reverse=True)
        best = {}
        for d in [d for docs in item["results"] for d in docs]:
            best[d["id"]] = max(best.get(d["id"], -1.0), d["score"])
        for d in merged:  # a document's merged score is its best score over query + rewrites
            assert d["score"] >= best.get(d["id"], -1.0) - 1e-6


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    queries=st.lists(
        st.text(
            st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=60
        ).filter(lambda t: t.strip() != ""),
        min_size=1,
        max_size=3,
    ),
    temperature=st.sampled_from([0.0, 0.7, 1.5]),
)
def test_constrained_rewrites_are_exactly_m(
    server: ApiServer, keys: dict[str, str], queries: list[str], temperature: float
) -> None:
    """format constrained (the default): every item is status ok with exactly m non-empty
    rewrites, for random queries and every m in 1..12."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for m in range(1, 13):
            body = {"queries": queries, "n_actions": m, "temperature": temperature, "line_cap": 3}
            r = c.post("/v1/rewrites", json=body, headers=auth(keys["user"]))
            assert r.status_code == 200, r.text
            for item in r.json()["items"]:
                assert item["status"] == "ok" and len(item["rewrites"]) == m, item
                assert all(rw["text"].strip() for rw in item["rewrites"])
                assert item["n_tokens"] <= m * (4 + 3 + 1)


def test_credit_round_trip_and_the_one_credit_path(
    client: httpx.Client, keys: dict[str, str], server: ApiServer, slice_path: Path
) -> None:
    qid = judged_query(slice_path)
    rewrites = ["vitamin D supplementation", "bone mineral density trial", "fracture risk"]
    r = client.post(
        "/v1/credits", json={"query_id": qid, "rewrites": rewrites}, headers=auth(keys["user"])
    )
    assert r.status_code == 201, r.text
    c = r.json()
    assert c["anchor_query"] is True and c["versions"]["evaluator_name"] == "replay"
    assert len(c["value_table"]) == 8 and len(c["phi"]) == 3
    assert sum(c["phi"]) == pytest.approx(c["value_full"] - c["value_empty"], abs=1e-9)
    assert abs(c["efficiency_residual"]) <= 1e-9
    assert sum(c["shaped_advantages"]) == pytest.approx(0.0, abs=1e-9)  # zero-sum shaping
    assert c["baselines"]["broadcast"] == [c["value_full"]] * 3
    assert c["cache"]["status"] == "ok"

    again = client.get(f"/v1/credits/{c['id']}", headers=auth(keys["user"]))
    assert again.status_code == 200 and again.json() == c

    warm = client.post(
        "/v1/credits", json={"query_id": qid, "rewrites": rewrites}, headers=auth(keys["user"])
    ).json()
    assert warm["id"] != c["id"] and warm["cache"]["misses"] == 0  # every action from Redis
    assert warm["phi"] == c["phi"]

    off = client.post(
        "/v1/credits",
        json={"query_id": qid, "rewrites": rewrites, "anchor_query": False},
        headers=auth(keys["user"]),
    ).json()
    assert off["anchor_query"] is False and off["value_empty"] == 0.0
    assert sum(off["phi"]) == pytest.approx(off["value_full"], abs=1e-9)


def test_credit_by_text_with_cosine(client: httpx.Client, keys: dict[str, str]) -> None:
    r = client.post(
        "/v1/credits",
        json={
            "query": "statins and heart disease",
            "rewrites": ["statin", "cholesterol lowering drugs"],
            "evaluator": "cosine",
        },
        headers=auth(keys["user"]),
    )
    assert r.status_code == 201, r.text
    assert r.json()["query_id"] == "adhoc" and len(r.json()["phi"]) == 2
    blank = client.post(  # an empty rewrite is no action: refused, naming it
        "/v1/credits", json={"query": "statins", "rewrites": ["statin", ""]},
        headers=auth(keys["user"]),
    )  # fmt: skip
    assert blank.status_code == 422 and "body.rewrites.1" in blank.text


def test_policies_list_and_read(client: httpx.Client, keys: dict[str, str]) -> None:
    listing = client.get("/v1/policies", headers=auth(keys["user"])).json()
    active = listing["active_version"]
    assert [p["version"] for p in listing["items"] if p["active"]] == [active]
    one = client.get(f"/v1/policies/{active[:8]}", headers=auth(keys["user"]))
    assert one.status_code == 200 and one.json()["version"] == active
    missing = client.get("/v1/policies/ffffffffffff", headers=auth(keys["user"]))
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"


def test_openapi_has_an_example_for_every_endpoint(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def has_example(content: dict) -> bool:
        for media in content.values():
            if "example" in media or "examples" in media:
                return True
            ref = media.get("schema", {}).get("$ref", "")
            schema = schemas[ref.rsplit("/", 1)[1]] if ref else {}
            if "examples" in schema or "example" in schema:
                return True
        return False

    missing = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {})
            ok = next((r for code, r in op["responses"].items() if code.startswith("2")), {})
            if not (has_example(body) or has_example(ok.get("content", {}))):
                missing.append(f"{method.upper()} {path}")
    assert missing == []
    assert client.get("/docs").status_code == 200


def test_concurrent_requests_share_a_generation(server: ApiServer, keys: dict[str, str]) -> None:
    """Dynamic batching: 8 concurrent one-query requests are generated together, and each
    gets exactly its own query's rewrites back."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> dict:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            body = {"queries": [f"claim number {i} about T cells"], "n_actions": 2}
            r = c.post("/v1/rewrites", json=body, headers=auth(keys["user"]))
            assert r.status_code == 200, r.text
            return r.json()

    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(one, range(8)))
    assert [o["items"][0]["query"] for o in out] == [
        f"claim number {i} about T cells" for i in range(8)
    ]
    assert max(o["batch_rows"] for o in out) > 1
