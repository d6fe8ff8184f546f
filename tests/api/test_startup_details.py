"""Issue 38, item 15: while the server starts, every route's 503 carried what start-up was
doing — the dataset's path, the index version, the progress — to callers without a key. Only
`/readyz` says it now; a request without a key is a 401 first, as once started; a request with
one gets a plain 503 `starting`.

The app of `create_app`, its lifespan not run: its start-up work is a `Startup` whose steps
this test sets, as `build_state` would (the full server doing a real index build is
`tests/hardening/test_serve_startup.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from app.api.startup import Startup
from app.main import create_app
from app.settings import get_settings

SECRET_DATASET = "/srv/private/datasets/claims-v7"
INDEX = "0b2e394d7f27"


@pytest.fixture()
def starting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("CASI_VAR_DIR", str(tmp_path / "var"))
    get_settings.cache_clear()
    app = create_app()
    get_settings.cache_clear()
    startup = Startup()
    startup.step(f"loading the dataset {SECRET_DATASET}")
    startup.step(f"building index {INDEX}")
    with startup.progress("documents")(5183) as advance:
        advance(1200)
    app.state.startup = startup
    yield TestClient(app)  # no `with`: the lifespan never runs, start-up never ends


def _no_details(text: str) -> None:
    for secret in (SECRET_DATASET, INDEX, "building index", "1200/5183", "documents"):
        assert secret not in text, (secret, text)


def test_only_readyz_says_what_start_up_is_doing(starting: TestClient) -> None:
    ready = starting.get("/readyz")
    assert ready.status_code == 503 and ready.headers["Retry-After"]
    assert ready.json()["reason"].startswith(f"starting: building index {INDEX}: 1200/5183")

    key = {"Authorization": "Bearer casi_not-checked-while-starting"}
    for method, path, body in (
        ("GET", "/v1/policies", None),
        ("POST", "/v1/credits", {"query_id": "0", "rewrites": ["a"]}),
        ("POST", "/v1/train-jobs", {"preset": "casi"}),
        ("GET", "/v1/audits/1", None),
    ):
        anonymous = starting.request(method, path, json=body)
        assert anonymous.status_code == 401, (path, anonymous.text)  # 401 before 503
        assert anonymous.json()["field"] == "header.Authorization"
        assert anonymous.headers["WWW-Authenticate"] == "Bearer"
        with_key = starting.request(method, path, json=body, headers=key)
        assert with_key.status_code == 503, (path, with_key.text)
        assert with_key.json()["error"] == "starting" and with_key.headers["Retry-After"]
        assert "/readyz" in with_key.json()["message"]
        _no_details(with_key.text)

    metrics = starting.get("/metrics")  # needs no key: a plain 503 too
    assert metrics.status_code == 503
    _no_details(metrics.text)
    for path in ("/ui/runs", "/ui/login"):  # the dashboard: a page that reloads itself
        page = starting.get(path)
        assert page.status_code == 503 and page.headers["content-type"].startswith("text/html")
        assert "The server is still starting." in page.text
        _no_details(page.text)
