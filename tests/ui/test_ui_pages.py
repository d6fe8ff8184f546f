"""The dashboard without a browser (httpx against the real, seeded server): login and sessions,
escaping, CSRF, scopes, validation shared with the REST API, pagination of thousands of credit
records, and an empty database."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ui_support import UiServer, make_settings

ADMIN_BUTTON = re.compile(r'class="admin')


def login(client: httpx.Client, key: str) -> httpx.Response:
    page = client.get("/ui/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf is not None
    return client.post("/ui/login", data={"key": key, "csrf": csrf.group(1), "next": "/ui/runs"})


def csrf_of(client: httpx.Client, path: str = "/ui/runs") -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', client.get(path).text)
    assert found is not None
    return found.group(1)


@pytest.fixture()
def user(ui_server: tuple[UiServer, Any], ui_keys: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ui_server[0].url, timeout=60) as c:
        assert login(c, ui_keys["user"]).status_code == 303
        yield c


@pytest.fixture()
def admin(ui_server: tuple[UiServer, Any], ui_keys: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ui_server[0].url, timeout=60) as c:
        assert login(c, ui_keys["admin"]).status_code == 303
        yield c


def test_login_sets_a_strict_httponly_session_and_never_the_key(ui_server, ui_keys) -> None:  # type: ignore[no-untyped-def]
    srv, _ = ui_server
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.get("/ui/runs")
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/login")
        wrong = login(c, "casi_not-a-key")
        assert wrong.status_code == 401 and "invalid or revoked" in wrong.text
        r = login(c, ui_keys["user"])
        assert r.status_code == 303 and r.headers["location"] == "/ui/runs"
        cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith("casi_ui="))
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
        assert ui_keys["user"] not in cookie and ui_keys["user"][5:] not in cookie
        page = c.get("/ui/runs")
        assert page.status_code == 200 and ui_keys["user"] not in page.text
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "http" not in csp and "unsafe-inline" not in csp
        assert "frame-ancestors 'none'" in csp
        # every asset the page loads comes from this server
        assert not re.search(r'(src|href)="(https?:)?//', page.text)
        # a forged token is no session
        c.cookies.set("casi_ui", cookie.split(";")[0].split("=", 1)[1][:-2] + "xx", path="/ui")
        assert c.get("/ui/runs").status_code == 303


def test_model_written_strings_are_escaped(user: httpx.Client, ui_server) -> None:  # type: ignore[no-untyped-def]
    _, seeded = ui_server
    page = user.get(f"/ui/credits/{seeded.xss_record_id}")
    assert page.status_code == 200
    assert "&lt;script&gt;document.title=&#39;pwned&#39;&lt;/script&gt;" in page.text
    assert "<script>document" not in page.text and "<b>bold</b>" not in page.text
    step = user.get(f"/ui/runs/{seeded.run_id}/steps/{seeded.explorer_step}")
    assert "<script>document" not in step.text and "&lt;script&gt;document" in step.text
    log = user.get(f"/ui/jobs/{seeded.job_id}")
    assert "<script>alert" not in log.text and "&lt;script&gt;alert(&#39;log&#39;)" in log.text
    policies = user.get("/ui/policies")
    assert (
        "warmstart <i>x</i>" not in policies.text
        and "warmstart &lt;i&gt;x&lt;/i&gt;" in policies.text
    )


def test_a_post_without_the_csrf_token_is_refused(admin: httpx.Client, ui_server) -> None:  # type: ignore[no-untyped-def]
    srv, seeded = ui_server
    served = srv.state.batcher.policy.version
    for data in ({}, {"csrf": "forged"}):
        r = admin.post(f"/ui/policies/{seeded.tiny_version}/activate", data=data)
        assert r.status_code == 403 and "CSRF" in r.text
        assert admin.post("/ui/jobs", data={**data, "preset": "casi"}).status_code == 403
        assert admin.post("/ui/logout", data=data).status_code == 403
    assert srv.state.batcher.policy.version == served
    with httpx.Client(base_url=srv.url, timeout=60) as c:  # the login form is tied the same way
        r = c.post("/ui/login", data={"key": "x", "csrf": "forged"})
        assert r.status_code == 403


def test_a_user_key_sees_no_admin_buttons_and_its_posts_get_403(
    user: httpx.Client, admin: httpx.Client, ui_server
) -> None:  # type: ignore[no-untyped-def]
    srv, seeded = ui_server
    for path in ("/ui/policies", f"/ui/policies/{seeded.tiny_version}", "/ui/jobs"):
        assert not ADMIN_BUTTON.search(user.get(path).text), path
        assert ADMIN_BUTTON.search(admin.get(path).text), path
    csrf = csrf_of(user)
    served = srv.state.batcher.policy.version
    for path, data in (
        (f"/ui/policies/{seeded.tiny_version}/activate", {}),
        ("/ui/jobs", {"preset": "casi", "steps": "1"}),
        (f"/ui/jobs/{seeded.job_id}/cancel", {}),
    ):
        r = user.post(path, data={**data, "csrf": csrf})
        assert r.status_code == 403 and "needs &#39;admin&#39;" in r.text, path
    assert srv.state.batcher.policy.version == served


def test_job_form_is_validated_as_the_rest_api(admin: httpx.Client) -> None:
    csrf = csrf_of(admin, "/ui/jobs")
    r = admin.post(
        "/ui/jobs", data={"csrf": csrf, "preset": "casi", "samples": "1", "steps": "two"}
    )
    assert r.status_code == 422
    assert "samples: Input should be greater than or equal to 2" in r.text
    assert "steps: Input should be a valid integer" in r.text
    r = admin.post("/ui/jobs", data={"csrf": csrf, "preset": "no-such-preset"})
    assert r.status_code == 422 and "unknown preset" in r.text
    r = admin.post("/ui/jobs", data={"csrf": csrf, "preset": "casi", "policy": "../etc"})
    assert r.status_code == 422 and "policy" in r.text


def test_admin_activates_a_policy_with_the_csrf_token(admin: httpx.Client, ui_server) -> None:  # type: ignore[no-untyped-def]
    srv, seeded = ui_server
    before = srv.state.batcher.policy.version
    csrf = csrf_of(admin, "/ui/policies")
    r = admin.post(f"/ui/policies/{seeded.tiny_version}/activate", data={"csrf": csrf})
    assert r.status_code == 303 and srv.state.batcher.policy.version == seeded.tiny_version
    assert "● served" in admin.get("/ui/policies").text
    r = admin.post(f"/ui/policies/{seeded.warm_version}/activate", data={"csrf": csrf})
    assert r.status_code == 409  # its folder does not exist: refused, the served one stays
    assert srv.state.batcher.policy.version == seeded.tiny_version
    assert admin.post(f"/ui/policies/{before}/activate", data={"csrf": csrf}).status_code == 303
    assert srv.state.batcher.policy.version == before


def test_thousands_of_credit_records_are_paginated(user: httpx.Client, ui_server) -> None:  # type: ignore[no-untyped-def]
    _, seeded = ui_server
    base = f"/ui/runs/{seeded.big_run_id}/steps/1"
    first = user.get(base)
    assert first.status_code == 200 and "700 queries" in first.text
    assert first.text.count('class="sample"') == 4 * 4  # 4 queries × G = 4 on a page
    assert "page 1 of 175" in first.text and f'href="{base}?page=1&amp;per=4"' in first.text
    last = user.get(base, params={"page": 174, "per": 4})
    assert last.status_code == 200 and 'data-query="q00699"' in last.text
    wide = user.get(base, params={"per": 10})
    assert wide.text.count('class="sample"') == 40
    assert user.get(base, params={"per": 11}).status_code == 422  # the page size is bounded
    beyond = user.get(base, params={"page": 1000})
    assert beyond.status_code == 200 and "No credit records on this page" in beyond.text
    # lists are not rebuilt for records of another index: said, not guessed
    assert "recorded on index other-index" in first.text
    run = user.get(f"/ui/runs/{seeded.big_run_id}")
    assert run.status_code == 200 and "2800 rollouts" in run.text


def test_unknown_things_are_404_pages(user: httpx.Client) -> None:
    for path in ("/ui/runs/999999", "/ui/credits/999999", "/ui/jobs/999999", "/ui/audits/999999",
                 "/ui/policies/abcdef123456", "/ui/runs/999999/steps/1"):  # fmt: skip
        r = user.get(path)
        assert r.status_code == 404 and r.headers["content-type"].startswith("text/html"), path


def test_revoking_the_key_ends_its_sessions(ui_server) -> None:  # type: ignore[no-untyped-def]
    from app.services.keys import create_key, revoke_key

    srv, _ = ui_server
    info, key = create_key(srv.state.factory, "short-lived", "user")
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert login(c, key).status_code == 303 and c.get("/ui/runs").status_code == 200
        revoke_key(srv.state.factory, info.id)
        assert c.get("/ui/runs").status_code == 303


def test_an_empty_database_renders(  # type: ignore[no-untyped-def]
    ui_var: Path, slice_path: Path, ui_redis_url: str, ui_policies: list[Path], tmp_path: Path
) -> None:
    from app.services.keys import create_key

    settings = make_settings(
        ui_var, slice_path, f"sqlite:///{tmp_path / 'empty.db'}", ui_redis_url, ui_policies[0]
    )
    srv = UiServer(settings).start()
    try:
        key = create_key(srv.state.factory, "empty", "admin")[1]
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert login(c, key).status_code == 303
            for path, text in (("/ui/runs", "No training runs yet"), ("/ui/jobs", "No training jobs"),
                               ("/ui/audits", "No audits yet"), ("/ui/policies", "served"),
                               ("/ui/compare", "Pick runs")):  # fmt: skip
                r = c.get(path)
                assert r.status_code == 200 and text in r.text, path
    finally:
        srv.stop()
