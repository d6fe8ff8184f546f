"""Outages: a private redis-server killed mid-traffic → still 200, `cache: degraded`; the
database unreachable (PostgreSQL behind a TCP proxy we stop) → 503 with Retry-After and
`/readyz` naming it, then served again once it is back."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_support import ApiServer, RedisServer, TcpProxy, app_conftest, auth, make_key, server_env
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from app.db.session import normalize_url

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def proxied_postgres() -> Iterator[tuple[str, TcpProxy]]:
    """A fresh schema on the test PostgreSQL, reached through a proxy (URL, proxy)."""
    helpers = app_conftest()
    admin_url = normalize_url(helpers.require_postgres(helpers.pg_candidate_urls()))
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    proxy = TcpProxy((admin_url.host or "127.0.0.1", admin_url.port or 5432)).start()
    url = admin_url.set(host="127.0.0.1", port=proxy.port).update_query_dict(
        {"options": f"-csearch_path={schema}"}
    )
    try:
        yield url.render_as_string(hide_password=False), proxy
    finally:
        proxy.stop()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(scope="module")
def outage(
    tmp_path_factory: pytest.TempPathFactory, api_var: Path, slice_path: Path,
    tiny_policies: list[Path], proxied_postgres: tuple[str, TcpProxy],
) -> Iterator[tuple[ApiServer, RedisServer, TcpProxy, dict[str, str]]]:  # fmt: skip
    db_url, proxy = proxied_postgres
    redis = RedisServer().start()
    env = server_env(var=api_var, dataset=slice_path, database_url=db_url,
                     redis_url=redis.url, policy=tiny_policies[0])  # fmt: skip
    srv = ApiServer(env, tmp_path_factory.mktemp("outage") / "server.log").start()
    keys = {f"k{i}": make_key(db_url, "user", f"k{i}") for i in range(3)}
    yield srv, redis, proxy, keys
    srv.stop()
    redis.kill()


def test_bad_values_on_postgresql_are_4xx_not_an_outage(outage: tuple) -> None:
    """Issue 18 §2: these were 503 "database is unreachable" (with Retry-After) on PostgreSQL."""
    srv, _, _, keys = outage
    h = auth(keys["k2"])
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/v1/credits/2147483648", headers=h).status_code == 422
        assert c.get("/v1/credits/2147483647", headers=h).status_code == 404
        assert c.get("/v1/policies/%00", headers=h).status_code == 422
        body = {"query": "statins\u0000", "rewrites": ["a\u0000"], "evaluator": "cosine"}
        r = c.post("/v1/credits", json=body, headers=h)  # JSON carries it as \\u0000
        assert r.status_code == 422, r.text


def test_redis_killed_mid_traffic_still_served_degraded(outage: tuple) -> None:
    srv, redis, _, keys = outage
    qid = (
        (Path(srv.env["CASI_DATASET"]) / "qrels" / "train.tsv")
        .read_text()
        .splitlines()[1]
        .split("\t")[0]
    )
    credit = {"query_id": qid, "rewrites": ["vitamin D", "bone density"]}
    results: list[tuple[float, int, str]] = []
    stop, lock = threading.Event(), threading.Lock()

    def traffic(key: str, path: str, body: dict) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            while not stop.is_set():
                r = c.post(path, json=body, headers=auth(key))
                j = r.json()
                cache = j.get("cache")
                status = cache["status"] if isinstance(cache, dict) else cache
                with lock:
                    results.append((time.monotonic(), r.status_code, str(status)))

    rewrite = {"queries": ["statins and heart disease"], "n_actions": 2, "include_results": True}
    threads = [
        threading.Thread(target=traffic, args=(keys["k0"], "/v1/credits", credit)),
        threading.Thread(target=traffic, args=(keys["k1"], "/v1/rewrites", rewrite)),
    ]
    for t in threads:
        t.start()
    time.sleep(2.0)
    redis.kill()
    killed = time.monotonic()
    time.sleep(2.5)
    stop.set()
    for t in threads:
        t.join(timeout=60)

    assert {code for _, code, _ in results} <= {200, 201}, results
    before = [s for at, _, s in results if at < killed - 0.5]
    after = [s for at, _, s in results if at > killed + 0.5]
    assert before and set(before) == {"ok"}
    assert after and set(after) == {"degraded"}
    ready = httpx.get(srv.url + "/readyz", timeout=30)  # only the cache is down: still ready
    assert ready.status_code == 200 and ready.json()["down"] == ["redis"]
    assert ready.json()["status"] == "degraded"


def test_database_down_is_503_with_retry_after_then_recovers(outage: tuple) -> None:
    srv, _, proxy, keys = outage
    h = auth(keys["k2"])
    body = {"query": "statins and heart disease", "rewrites": ["statin"], "evaluator": "cosine"}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.post("/v1/credits", json=body, headers=h).status_code == 201
        proxy.stop()
        try:
            for path, method in (("/v1/credits", "post"), ("/v1/policies", "get")):
                r = c.request(method, path, json=body if method == "post" else None, headers=h)
                assert r.status_code == 503, r.text
                assert (
                    r.json()["error"] == "database_unavailable" and r.json()["field"] == "database"
                )
                assert int(r.headers["retry-after"]) > 0
            ready = c.get("/readyz")
            assert ready.status_code == 503 and "database" in ready.json()["down"]
            assert c.get("/healthz").status_code == 200
        finally:
            proxy.start()
        deadline = time.monotonic() + 30
        while c.post("/v1/credits", json=body, headers=h).status_code != 201:
            assert time.monotonic() < deadline, "not served again after the database came back"
            time.sleep(0.5)


def test_database_down_at_start_up_then_the_policy_is_registered(
    tmp_path: Path, api_var: Path, slice_path: Path, tiny_policies: list[Path], redis_url: str,
) -> None:  # fmt: skip
    """Issue 18 §5: started with the database down, the served policy was never registered."""
    helpers = app_conftest()
    admin_url = normalize_url(helpers.require_postgres(helpers.pg_candidate_urls()))
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    proxy = TcpProxy((admin_url.host or "127.0.0.1", admin_url.port or 5432))  # not started
    url = (
        admin_url.set(host="127.0.0.1", port=proxy.port)
        .update_query_dict({"options": f"-csearch_path={schema}"})
        .render_as_string(hide_password=False)
    )
    env = server_env(var=api_var, dataset=slice_path, database_url=url, redis_url=redis_url,
                     policy=tiny_policies[0])  # fmt: skip
    srv = ApiServer(env, tmp_path / "server.log").start()
    try:
        assert httpx.get(srv.url + "/readyz", timeout=30).status_code == 503
        proxy.start()
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/readyz", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, srv.log()[-2000:]
            time.sleep(0.5)
        h = auth(make_key(url, "user", "late"))
        deadline = time.monotonic() + 30
        while not (listing := httpx.get(srv.url + "/v1/policies", headers=h).json())["items"]:
            assert time.monotonic() < deadline, "the served policy was never registered"
            time.sleep(0.5)
        active = listing["active_version"]
        assert [p["version"] for p in listing["items"]] == [active]
        assert httpx.get(f"{srv.url}/v1/policies/{active}", headers=h).status_code == 200
    finally:
        srv.stop()
        proxy.stop()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
