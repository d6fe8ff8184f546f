"""Policy activation under concurrent rewrite traffic: the served version changes and no
request fails (the new policy is built off the event loop, then swapped in one assignment)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from api_support import ApiServer, auth, make_key

pytestmark = pytest.mark.integration
CLIENTS = 4


def register(database_url: str, path: Path) -> str:
    """Register a saved policy folder as a version; returns its version."""
    from app.db import repositories as repo
    from app.db import session_scope
    from app.db.session import make_engine, make_session_factory
    from policy.model import load_policy, policy_version

    model, _ = load_policy(path, path.parent, progress=False)
    version = policy_version(model)
    engine = make_engine(database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            repo.add_policy_version(
                session, version=version, name=path.name, base_model=str(path), path=str(path),
                kind="trained",
            )  # fmt: skip
    finally:
        engine.dispose()
    return version


def test_activation_during_traffic_fails_no_request(
    server: ApiServer, client: httpx.Client, keys: dict[str, str], tiny_policies: list[Path]
) -> None:
    db = server.env["DATABASE_URL"]
    before = client.get("/v1/policies", headers=auth(keys["user"])).json()["active_version"]
    new = register(db, tiny_policies[1])
    assert new != before
    stop, results, lock = threading.Event(), [], threading.Lock()

    def traffic(i: int) -> None:
        key = make_key(db, "user", f"traffic-{i}")
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while not stop.is_set():
                r = c.post(
                    "/v1/rewrites", json={"queries": [f"claim {i} about cells"], "n_actions": 2},
                    headers=auth(key),
                )  # fmt: skip
                with lock:
                    results.append((r.status_code, r.json().get("policy_version")))

    threads = [threading.Thread(target=traffic, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    r = client.post(f"/v1/policies/{new[:8]}/activate", headers=auth(keys["admin"]))
    assert r.status_code == 200, r.text
    assert r.json()["version"] == new and r.json()["active"] is True
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(timeout=60)

    statuses = [s for s, _ in results]
    assert statuses and set(statuses) == {200}, statuses
    served = [v for _, v in results]
    assert served[0] == before and served[-1] == new  # old before the swap, new after it
    assert set(served) == {before, new}
    listing = client.get("/v1/policies", headers=auth(keys["user"])).json()
    assert listing["active_version"] == new
    assert {p["version"] for p in listing["items"] if p["active"]} == {new}


def test_a_version_says_where_it_was_made(
    server: ApiServer, client: httpx.Client, keys: dict[str, str]
) -> None:
    """`made_on` and `imported` come from the registration (`casi policy import` records them)."""
    from app.db import repositories as repo
    from app.db import session_scope
    from app.db.session import make_engine, make_session_factory

    zen4 = "AuthenticAMD family 25 model 17 stepping 1"
    engine = make_engine(server.env["DATABASE_URL"])
    try:
        with session_scope(make_session_factory(engine)) as session:
            repo.add_policy_version(
                session, version="c0ffee000001", name="warmstart", base_model="b", path="/p",
                kind="warmstart", meta={"made_on": zen4, "imported_from": "start.tar"},
            )  # fmt: skip
    finally:
        engine.dispose()
    one = client.get("/v1/policies/c0ffee000001", headers=auth(keys["user"])).json()
    assert (one["made_on"], one["imported"]) == (zen4, True)
    listing = client.get("/v1/policies", headers=auth(keys["user"])).json()["items"]
    active = [p for p in listing if p["active"]]
    assert [(p["made_on"], p["imported"]) for p in active] == [(None, False)]  # served base
