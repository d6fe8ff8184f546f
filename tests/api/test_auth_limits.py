"""Auth (no key, bad key, revoked, wrong scope), per-key rate limit, input limits and bad
bodies: every 4xx is JSON naming the field, and no input produces a 500. Keys never reach the
server's log. CORS is closed by default."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from api_support import ROOT, ApiServer, auth, make_key

pytestmark = pytest.mark.integration
SERVER_ENV = {  # read by the `server` fixture
    "CASI_API_MAX_QUERIES": "4",
    "CASI_API_MAX_QUERY_CHARS": "200",
    "CASI_API_RATE_PER_S": "0.05",  # one token per 20 s: a loaded machine cannot refill the burst mid-test
    "CASI_API_RATE_BURST": "60",
}


def assert_error(r: httpx.Response, status: int, field: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["field"] == field, body
    assert body["message"] and body["error"]
    return body


def test_no_key_bad_key_and_both_headers(client: httpx.Client) -> None:
    body = {"queries": ["q"]}
    r = client.post("/v1/rewrites", json=body)
    assert_error(r, 401, "header.Authorization")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_error(
        client.post("/v1/rewrites", json=body, headers=auth("casi_nope")),
        401,
        "header.Authorization",
    )
    assert_error(
        client.get("/v1/policies", headers={"X-API-Key": "casi_nope"}), 401, "header.Authorization"
    )


def test_x_api_key_header_works(client: httpx.Client, keys: dict[str, str]) -> None:
    assert client.get("/v1/policies", headers={"X-API-Key": keys["user"]}).status_code == 200


def test_user_key_on_admin_endpoints_is_403(client: httpx.Client, keys: dict[str, str]) -> None:
    user = auth(keys["user"])
    assert_error(
        client.post("/v1/train-jobs", json={"preset": "casi"}, headers=user),
        403,
        "header.Authorization",
    )
    assert_error(client.post("/v1/train-jobs/1/cancel", headers=user), 403, "header.Authorization")
    r = client.post("/v1/policies/abcdef/activate", headers=user)
    assert_error(r, 403, "header.Authorization")


def test_cli_keys_create_list_revoke(server: ApiServer, client: httpx.Client) -> None:
    env = server.env

    def casi(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "app.cli", "keys", *args], env=env, cwd=ROOT,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    key = casi("create", "--scope", "admin", "--name", "cli").strip().splitlines()[-1]
    assert key.startswith("casi_")
    assert client.get("/v1/train-jobs", headers=auth(key)).status_code == 200
    listing = casi("list")
    assert key[:8] in listing and key not in listing  # only the prefix is ever shown
    key_id = next(line.split("│")[1].strip() for line in listing.splitlines() if " cli " in line)
    casi("revoke", key_id)
    assert_error(client.get("/v1/train-jobs", headers=auth(key)), 401, "header.Authorization")
    assert key not in server.log()  # never logged


def test_rate_limit_429_with_retry_after(server: ApiServer, client: httpx.Client) -> None:
    key = make_key(server.env["DATABASE_URL"], "user", "burst")
    statuses = [client.get("/healthz").status_code]
    for _ in range(int(server.env["CASI_API_RATE_BURST"]) + 5):
        statuses.append(client.get("/v1/policies", headers=auth(key)).status_code)
    assert 429 in statuses
    r = client.get("/v1/policies", headers=auth(key))
    assert_error(r, 429, "header.Authorization")
    assert int(r.headers["retry-after"]) >= 1
    other = make_key(server.env["DATABASE_URL"], "user", "other")  # per key, not global
    assert client.get("/v1/policies", headers=auth(other)).status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"queries": ["q"], "n_actions": 13}, "body.n_actions"),
        ({"queries": ["q"], "n_actions": 0}, "body.n_actions"),
        ({"queries": []}, "body.queries"),
        ({"queries": ["q"] * 5}, "body.queries"),  # over CASI_API_MAX_QUERIES=4
        ({"queries": ["x" * 300]}, "body.queries.0"),  # over CASI_API_MAX_QUERY_CHARS=200
        ({"queries": ["  "]}, "body.queries.0"),
        ({"queries": "not a list"}, "body.queries"),
        ({"queries": [1, 2]}, "body.queries.0"),
        ({"queries": ["q"], "temperature": -1}, "body.temperature"),
        ({"queries": ["q"], "max_new_tokens": 100000}, "body.max_new_tokens"),
        ({}, "body.queries"),
    ],
)
def test_rewrite_limits(client: httpx.Client, keys: dict[str, str], body: dict, field: str) -> None:
    assert_error(client.post("/v1/rewrites", json=body, headers=auth(keys["admin"])), 422, field)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"query_id": "0", "rewrites": ["a"] * 13}, "body.rewrites"),
        ({"query_id": "0", "rewrites": []}, "body.rewrites"),
        ({"rewrites": ["a"]}, "body.query"),
        ({"query_id": "0", "rewrites": ["a"], "evaluator": "oracle"}, "body.evaluator"),
        ({"query_id": "0", "rewrites": ["a"], "evaluator": "surrogate"}, "body.evaluator"),
        ({"query_id": "0", "rewrites": ["a" * 5000]}, "body.rewrites.0"),
    ],
)
def test_credit_limits(client: httpx.Client, keys: dict[str, str], body: dict, field: str) -> None:
    assert_error(client.post("/v1/credits", json=body, headers=auth(keys["admin"])), 422, field)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"query_id": "no-such-id", "rewrites": ["a"]}, "body.query_id"),
        ({"query": "not a judged claim at all", "rewrites": ["a"]}, "body.query"),  # replay
    ],
)
def test_a_query_the_dataset_lacks_is_404(
    client: httpx.Client, keys: dict[str, str], body: dict, field: str
) -> None:
    """Issue 27: a schema-valid body naming data the server lacks is 404 (as an unknown policy
    version is), not 422: 422 is for a body the documented schema and limits refuse."""
    assert_error(client.post("/v1/credits", json=body, headers=auth(keys["admin"])), 404, field)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"preset": "no-such-preset"}, "body.preset"),
        ({"preset": "../../etc/passwd"}, "body.preset"),
        ({"preset": "casi", "steps": 0}, "body.steps"),
        ({"preset": "casi", "policy": "/etc/passwd"}, "body.policy"),
        ({"preset": "casi", "samples": 1}, "body.samples"),
    ],
)
def test_job_limits(client: httpx.Client, keys: dict[str, str], body: dict, field: str) -> None:
    assert_error(client.post("/v1/train-jobs", json=body, headers=auth(keys["admin"])), 422, field)


def test_bad_bodies_are_json_errors(client: httpx.Client, keys: dict[str, str]) -> None:
    h = {**auth(keys["admin"]), "content-type": "application/json"}
    assert_error(client.post("/v1/rewrites", content=b'{"queries": [', headers=h), 422, "body")
    assert_error(client.post("/v1/rewrites", content=b"\xff\xfe", headers=h), 422, "body")
    assert_error(client.post("/v1/credits", content=b"null", headers=h), 422, "body")
    big = b'{"queries": ["' + b"a" * 70_000 + b'"]}'
    assert_error(client.post("/v1/rewrites", content=big, headers=h), 413, "body")
    assert_error(client.get("/v1/credits/not-a-number", headers=h), 422, "path.record_id")
    assert_error(client.get("/v1/credits/999999", headers=h), 404, "path.record_id")
    assert_error(client.get("/v1/train-jobs?limit=1000", headers=h), 422, "query.limit")
    assert_error(client.get("/no/such/route"), 404, "path")
    assert_error(client.delete("/v1/rewrites", headers=h), 405, "path")


def test_nothing_produces_a_500(server: ApiServer, client: httpx.Client) -> None:
    """A spread of hostile inputs on every POST endpoint: always a 2xx/4xx JSON answer."""
    nasty = [None, [], "", 0, -1, 1e308, "\x00", "🙂" * 50, {"a": {"b": [None]}}, [[[]]], True]
    for path in ("/v1/rewrites", "/v1/credits", "/v1/train-jobs", "/v1/policies/zz/activate"):
        h = auth(make_key(server.env["DATABASE_URL"], "admin", "fuzz"))  # a key per path: no 429
        for value in nasty:
            for body in (value, {"queries": value}, {"query_id": value, "rewrites": value},
                         {"preset": value}, {"query": value, "rewrites": [value]}):  # fmt: skip
                r = client.post(path, json=body, headers=h)
                assert r.status_code < 500, (path, body, r.text)
                assert r.status_code != 429 and r.headers["content-type"].startswith(
                    "application/json"
                )
    assert "Traceback" not in server.log()


def test_cors_closed_by_default(client: httpx.Client) -> None:
    r = client.options(
        "/v1/rewrites",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in r.headers
    r = client.get("/healthz", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_integers_past_the_database_range_are_422(
    client: httpx.Client, keys: dict[str, str]
) -> None:
    """Issue 18 §1: offsets and ids ≥ 2^31 (PostgreSQL int4) or ≥ 2^63 were 500s."""
    h = auth(keys["admin"])
    for big in (2**31, 2**63):
        for path, field in (
            (f"/v1/train-jobs?offset={big}", "query.offset"),
            (f"/v1/policies?offset={big}", "query.offset"),
            (f"/v1/audits?offset={big}", "query.offset"),
            (f"/v1/credits/{big}", "path.record_id"),
            (f"/v1/train-jobs/{big}", "path.job_id"),
            (f"/v1/audits/{big}", "path.audit_id"),
            (f"/v1/audits/{big}/report", "path.audit_id"),
        ):
            assert_error(client.get(path, headers=h), 422, field)
    assert client.get(f"/v1/train-jobs?offset={2**31 - 1}", headers=h).status_code == 200


def test_bad_text_and_coerced_values_are_422(client: httpx.Client, keys: dict[str, str]) -> None:
    h = auth(keys["admin"])
    assert_error(client.get("/v1/policies/%00", headers=h), 422, "path.version")
    credit = {"query_id": "0", "rewrites": ["a\u0000b"]}
    assert_error(client.post("/v1/credits", json=credit, headers=h), 422, "body.rewrites.0")
    credit = {"query_id": "0", "rewrites": ["a"], "anchor_query": 0}
    assert_error(client.post("/v1/credits", json=credit, headers=h), 422, "body.anchor_query")
    job = {"preset": "casi", "checkpoint_every": False}
    assert_error(client.post("/v1/train-jobs", json=job, headers=h), 422, "body.checkpoint_every")
    r = assert_error(client.get("/v1/policies/abcdef", headers=h), 404, "path.version")
    assert r["message"] == "no registered policy version 'abcdef'"  # balanced quotes


def test_audits_take_registered_versions_not_paths(
    client: httpx.Client, keys: dict[str, str]
) -> None:
    """Issue 18 §7: a filesystem path was accepted and its existence revealed."""
    h = auth(keys["admin"])
    for path in ("/etc/passwd", "/no/such/folder", "../var"):
        body = {"evaluator": "cosine", "policy": path}
        r = assert_error(client.post("/v1/audits", json=body, headers=h), 422, "body.policy")
        assert "exist" not in r["message"]
    body = {"evaluator": "cosine", "policy": "abcdef12"}
    assert_error(client.post("/v1/audits", json=body, headers=h), 404, "body.policy")


def test_failed_authentications_are_429_per_address(
    client: httpx.Client, keys: dict[str, str]
) -> None:
    """Issue 18 §7: 300 of 300 wrong keys got 401. LAST in this module: it blocks 127.0.0.1."""
    statuses = [
        client.get("/v1/policies", headers=auth(f"casi_wrong{i}")).status_code for i in range(40)
    ]
    assert set(statuses) == {401, 429} and statuses[-1] == 429, statuses
    r = client.get("/v1/policies", headers=auth(keys["user"]))  # even a good key, from here
    assert_error(r, 429, "header.Authorization")
    assert int(r.headers["retry-after"]) >= 1
