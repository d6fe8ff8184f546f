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
from ui_seed import ZEN4
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
    one = user.get(f"/ui/policies/{seeded.warm_version}")  # where it was made, and imported
    assert (
        f'<td id="made-on">{ZEN4} (imported from <code>start&lt;b&gt;.tar</code>)</td>' in one.text
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


def test_non_ascii_tokens_are_refused_not_a_500(admin: httpx.Client, ui_server) -> None:  # type: ignore[no-untyped-def]
    """hmac.compare_digest refuses str with non-ASCII characters: a non-ASCII session cookie
    made every /ui page a 500 (that browser locked out until its cookies were cleared), and a
    non-ASCII or non-UTF-8 csrf field a 500 on the login form and every admin form."""
    srv, _ = ui_server
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for path in ("/ui/login", "/ui/runs"):
            r = c.get(path, headers={"cookie": b"casi_ui=abc.d\xc3\xa9f"})
            assert r.status_code in (200, 303), (path, r.status_code)
        r = c.post("/ui/login", content=b"csrf=%C3%A9&key=x",
                   headers={"content-type": "application/x-www-form-urlencoded"})  # fmt: skip
        assert r.status_code == 403
    for body in (b"csrf=%C3%A9&preset=casi", b"csrf=\xe9&preset=casi"):
        r = admin.post("/ui/jobs", content=body,
                       headers={"content-type": "application/x-www-form-urlencoded"})  # fmt: skip
        assert r.status_code == 403 and "CSRF" in r.text


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
    # issue 38, item 16: an unknown version was accepted and the job failed seconds later
    r = admin.post("/ui/jobs", data={"csrf": csrf, "preset": "casi", "policy": "abcdef0123456789"})
    assert r.status_code == 404 and "body.policy: no registered policy version" in r.text


def _select(page: str, name: str) -> tuple[list[str], list[str], list[str]]:
    """A <select>'s option values, the selected ones and the disabled ones."""
    found = re.search(rf'<select name="{name}"[^>]*>(.*?)</select>', page, re.S)
    assert found is not None, f"no <select name={name!r}>"
    options = re.findall(r'<option value="([^"]*)"([^>]*)>', found.group(1))
    return ([v for v, _ in options], [v for v, a in options if "selected" in a],
            [v for v, a in options if "disabled" in a])  # fmt: skip


def test_the_job_form_defaults_to_casi_and_offers_only_valid_values(
    admin: httpx.Client, ui_server
) -> None:  # type: ignore[no-untyped-def]
    """Issue 27: the form defaulted to the first preset in the alphabet (async-stale) and took
    evaluator, format and policy as free text."""
    from app.db import session_scope
    from app.db.models import PolicyVersion
    from app.schemas import EVALUATORS
    from policy.losses import available_presets

    srv, seeded = ui_server
    page = admin.get("/ui/jobs").text
    presets, chosen, _ = _select(page, "preset")
    assert presets == available_presets() and chosen == ["casi"]
    evaluators, chosen, off = _select(page, "evaluator")
    assert evaluators == ["", *EVALUATORS] and chosen == [""]  # blank: the preset's default
    assert "replay" not in off and set(off) == {e for e in EVALUATORS if e not in srv.state.scorers}
    formats, chosen, _ = _select(page, "format")
    assert formats == ["", "constrained", "free"] and chosen == [""]
    policies, chosen, _ = _select(page, "policy")
    with session_scope(srv.state.factory) as s:
        registered = {v for (v,) in s.query(PolicyVersion.version)}
    assert policies[0] == "" and chosen == [""] and set(policies[1:]) == registered
    assert {seeded.warm_version, seeded.tiny_version, seeded.ckpt_version} <= registered
    for name in ("preset", "evaluator", "format", "policy"):
        assert f'<input name="{name}"' not in page, name
    # a refused form comes back with what was picked
    csrf = csrf_of(admin, "/ui/jobs")
    r = admin.post("/ui/jobs", data={"csrf": csrf, "preset": "grpo", "evaluator": "cosine",
                                     "format": "free", "policy": seeded.tiny_version, "samples": "1"})  # fmt: skip
    assert r.status_code == 422 and "samples" in r.text
    for name, value in (("preset", "grpo"), ("evaluator", "cosine"), ("format", "free"),
                        ("policy", seeded.tiny_version)):  # fmt: skip
        assert _select(r.text, name)[1] == [value], name


def test_run_page_metrics_keep_their_precision_and_the_credit_links_come_first(  # type: ignore[no-untyped-def]
    user: httpx.Client, ui_server
) -> None:
    """Issue 27: the tables printed four decimals (lr 1e-5, a gradient norm of 2.9e-9 and a
    loss of 4.6e-18 all read 0.0000), and the credit-explorer links sat under ~50 raw rows."""
    from app.db import repositories as repo
    from app.db import session_scope
    from app.db.models import TrainingRun

    srv, seeded = ui_server
    metrics = {"update/lr": 1e-5, "grad_norm": 2.9e-9, "loss": 4.6e-18, "kl/value": 0.0,
               "reward_mean": 0.61234, "time/step_s": 12345.6}  # fmt: skip
    with session_scope(srv.state.factory) as s:
        source = s.get(TrainingRun, seeded.run_id)
        assert source is not None
        run = repo.create_run(s, name="tiny-numbers", preset="casi", config=dict(source.config))
        repo.add_step_metrics(s, run.id, 1, metrics)
        repo.add_credit_records(s, ui_seed_records(run.id))
        run_id = run.id
    page = user.get(f"/ui/runs/{run_id}").text
    table = re.search(r'<table class="grid compact" id="last-metrics">(.*?)</table>', page, re.S)
    assert table is not None
    shown = dict(
        re.findall(r'<tr><td>([^<]+)</td><td class="num">([^<]*)</td></tr>', table.group(1))
    )
    assert shown == {"update/lr": "1e-05", "grad_norm": "2.9e-09", "loss": "4.6e-18",
                     "kl/value": "0", "reward_mean": "0.6123", "time/step_s": "12346"}  # fmt: skip
    assert "0.0000" not in table.group(1)
    for rid in (run_id, seeded.run_id):
        page = user.get(f"/ui/runs/{rid}").text
        assert 0 < page.index('id="credit-steps"') < page.index('id="last-metrics"'), rid


def ui_seed_records(run_id: int) -> list[dict[str, Any]]:
    import ui_seed

    return ui_seed._synthetic_records(run_id, 1, 1, 2)


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


def test_an_admin_cancels_a_running_audit_from_its_page(  # type: ignore[no-untyped-def]
    admin: httpx.Client, user: httpx.Client, ui_server, tmp_path: Path
) -> None:
    """Issue 27 item 4: an audit page had no Cancel (and the API no cancel route). The button
    posts with the CSRF token, admin only; the audit's process group ends, it reads cancelled."""
    import subprocess
    import sys

    from app.services import audit as audit_service

    srv, seeded = ui_server
    factory = srv.state.factory
    audit_id = audit_service.create_pending(
        factory, audit_service.AuditRequest(evaluators=("cosine",), from_run=seeded.run_id)
    )
    proc = subprocess.Popen(  # stands in for `casi audit run ... --into ID` (same markers)
        [sys.executable, "-c", "import time; time.sleep(300)", "--into", str(audit_id)],
        start_new_session=True,
    )
    try:
        assert audit_service.set_status(factory, audit_id, "running", pid=proc.pid)
        path = f"/ui/audits/{audit_id}"
        page = admin.get(path).text
        assert f'action="{path}/cancel"' in page and 'id="cancel-audit"' in page
        assert 'id="cancel-audit"' not in user.get(path).text  # no button for a user key
        assert user.post(f"{path}/cancel", data={"csrf": csrf_of(user)}).status_code == 403
        assert admin.post(f"{path}/cancel", data={"csrf": "forged"}).status_code == 403
        assert proc.poll() is None  # refused posts changed nothing
        r = admin.post(f"{path}/cancel", data={"csrf": csrf_of(admin, path)})
        assert r.status_code == 303 and r.headers["location"] == path
        assert proc.wait(timeout=20) != 0  # its process group was ended
        after = admin.get(path).text
        assert 'id="audit-status">cancelled<' in after and "cancelled by request" in after
        assert 'id="cancel-audit"' not in after
        again = admin.post(f"{path}/cancel", data={"csrf": csrf_of(admin, path)})
        assert again.status_code == 303  # idempotent, as the REST API's
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    finished = f"/ui/audits/{seeded.audit_id}"
    assert 'id="cancel-audit"' not in admin.get(finished).text
    r = admin.post(f"{finished}/cancel", data={"csrf": csrf_of(admin, finished)})
    assert r.status_code == 409 and "already finished" in r.text
    r = admin.post("/ui/audits/999999/cancel", data={"csrf": csrf_of(admin)})
    assert r.status_code == 404


def test_the_credit_pages_show_every_credit_and_what_each_rewrite_found(  # type: ignore[no-untyped-def]
    user: httpx.Client, ui_server
) -> None:
    """Issue 27 item 6, on the real seeded records (real retrieval, replay): broadcast beside
    φ / singleton / leave-one-out, each rewrite's own top-k with the dataset's titles, the
    shaped-x line, and the stored API credits reachable from the menu."""
    import html

    srv, seeded = ui_server
    assert '<a href="/ui/credits">API credits</a>' in user.get("/ui/runs").text
    listing = user.get("/ui/credits")
    assert listing.status_code == 200
    assert f'<a href="/ui/credits/{seeded.api_credit_id}">' in listing.text
    assert not any(f'<a href="/ui/credits/{i}">' in listing.text for i in seeded.credit_ids)

    page = user.get(f"/ui/credits/{seeded.api_credit_id}").text
    v_full = re.search(r'class="v-full" data-value="([^"]+)"', page)
    assert v_full is not None
    cells = re.findall(r'<td class="num broadcast [\w-]+" data-value="([^"]*)"', page)
    assert [float(v) for v in cells] == [float(v_full.group(1))] * 2  # v(N) on each rewrite
    titles = {d.doc_id: d.title for d in srv.state.retrieval.dataset.documents}
    sections = re.findall(r'<section class="own" data-action="(\d)">(.*?)</section>', page, re.S)
    assert [j for j, _ in sections] == ["0", "1"]
    for _, body in sections:
        docs = re.findall(r'data-doc="([^"]+)".*?<span class="title">([^<]*)</span>', body)
        assert len(docs) == srv.state.settings.retrieval_k
        assert [html.unescape(t) for _, t in docs] == [titles[d] or "(no title)" for d, _ in docs]
    assert 'id="shaped-note"' in page and "+1.10" in page

    step = user.get(f"/ui/runs/{seeded.run_id}/steps/{seeded.explorer_step}").text
    assert step.count('<section class="own"') == 3 * 3 * 3  # queries × samples × rewrites
    assert step.count('<td class="num broadcast') == 27 and 'id="shaped-note"' in step


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


def _cookie_cleared(r: httpx.Response) -> bool:
    return any(
        h.startswith("casi_ui=") and "Max-Age=0" in h for h in r.headers.get_list("set-cookie")
    )


def test_a_revoked_key_lands_on_the_login_form_not_in_a_redirect_loop(ui_server) -> None:  # type: ignore[no-untyped-def]
    """Issue 27: a revoked key's session went /ui/runs → /ui/login → /ui/runs … forever (the
    login page took the signed cookie for a session without asking whether its key was still
    active). Now the session is cleared and the login form says why."""
    from app.services.keys import create_key, revoke_key

    srv, _ = ui_server
    info, key = create_key(srv.state.factory, "to-revoke", "user")
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert login(c, key).status_code == 303 and c.get("/ui/jobs").status_code == 200
        stale = c.cookies.get("casi_ui")
        assert stale
        revoke_key(srv.state.factory, info.id)
        r = c.get("/ui/jobs")
        assert r.status_code == 303
        assert r.headers["location"] == "/ui/login?next=/ui/jobs&ended=revoked"
        assert _cookie_cleared(r) and c.cookies.get("casi_ui") is None
        form = c.get(r.headers["location"])
        assert form.status_code == 200 and 'id="login-form"' in form.text
        assert 'id="login-ended"' in form.text and "API key was revoked" in form.text
        assert 'name="next" value="/ui/jobs"' in form.text
        # every page, followed to its end: the form, after one redirect
        for path in ("/ui/runs", "/ui/policies", "/ui/login"):
            end = c.get(path, follow_redirects=True)
            assert end.status_code == 200 and 'id="login-form"' in end.text, path
            assert len(end.history) <= 1, [h.headers.get("location") for h in end.history]
    # a browser that still sends the revoked session to the login page itself: the form and
    # the cookie deleted (this answered 303 back to the page before)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        c.cookies.set("casi_ui", stale, path="/ui")
        r = c.get("/ui/login", params={"next": "/ui/runs"})
        assert r.status_code == 200 and "API key was revoked" in r.text and _cookie_cleared(r)
        end = c.get("/ui/runs", follow_redirects=True)
        assert end.status_code == 200 and 'id="login-form"' in end.text
        # logging in again with an active key works at once
        other = create_key(srv.state.factory, "replacement", "user")[1]
        assert login(c, other).status_code == 303 and c.get("/ui/runs").status_code == 200


def test_an_expired_session_is_cleared_and_said(ui_server, ui_keys) -> None:  # type: ignore[no-untyped-def]
    import time

    from app.services.keys import authenticate
    from app.ui import security

    srv, _ = ui_server
    who = authenticate(srv.state.factory, ui_keys["user"])
    assert who is not None
    secret = security.secret_for(srv.state.settings.var_dir)
    expired = security.issue_session(
        secret, who.key_id, now=time.time() - security.SESSION_TTL_S - 60
    )
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        c.cookies.set("casi_ui", expired, path="/ui")
        r = c.get("/ui/runs")
        assert r.status_code == 303 and r.headers["location"].endswith("&ended=expired")
        assert _cookie_cleared(r)
        form = c.get(r.headers["location"])
        assert form.status_code == 200 and "session expired" in form.text
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        c.cookies.set("casi_ui", expired, path="/ui")
        r = c.get("/ui/login")
        assert r.status_code == 200 and "session expired" in r.text and _cookie_cleared(r)
    with httpx.Client(base_url=srv.url, timeout=60) as c:  # no cookie at all: no message
        r = c.get("/ui/login")
        assert r.status_code == 200 and 'id="login-ended"' not in r.text
        # the reason is a fixed text chosen by a key, never echoed from the address
        r = c.get("/ui/login", params={"ended": "<b>x</b>"})
        assert r.status_code == 200 and 'id="login-ended"' not in r.text and "<b>x" not in r.text


def test_errors_under_ui_are_pages_and_the_api_keeps_json(
    user: httpx.Client, ui_server, ui_keys
) -> None:  # type: ignore[no-untyped-def]
    """Issue 27: an out-of-range id answered the REST API's JSON 422 inside the dashboard."""
    srv, seeded = ui_server
    for path, status, says in (
        ("/ui/runs/999999999999999999999", 422, "run_id: Input should be less than or equal to"),
        ("/ui/runs/abc", 422, "run_id: Input should be a valid integer"),
        ("/ui/runs/1/steps/-1", 422, "step: Input should be greater than or equal to 0"),
        ("/ui/runs?page=-1", 422, "page: Input should be greater than or equal to 0"),
        ("/ui/credits/999999999999999999999", 422, "record_id"),
        ("/ui/policies/not-hex", 422, "version"),
        ("/ui/no-such-page", 404, "Not Found"),
        ("/ui/runs/999999", 404, "no training run 999999"),
        # issue 38, item 17: a step the run never reached was a 200 with an empty explorer
        (
            f"/ui/runs/{seeded.run_id}/steps/999999",
            404,
            f"training run {seeded.run_id} has no credit records at step 999999",
        ),
    ):
        r = user.get(path)
        assert r.status_code == status, (path, r.status_code, r.text[:200])
        assert r.headers["content-type"].startswith("text/html"), path
        assert 'id="error-message"' in r.text and says in r.text, (path, r.text)
        assert 'href="/ui/runs" id="error-back"' in r.text
        assert r.headers["content-security-policy"].startswith("default-src 'none'")
    r = user.delete("/ui/runs")
    assert r.status_code == 405 and r.headers["content-type"].startswith("text/html")
    assert "GET" in r.headers["allow"]
    csrf = csrf_of(user)
    r = user.post("/ui/jobs", data={"csrf": csrf, "preset": "casi"})
    assert r.status_code == 403 and r.headers["content-type"].startswith("text/html")
    # the REST API under /v1 keeps its JSON errors
    with httpx.Client(base_url=srv.url, timeout=60,
                      headers={"Authorization": f"Bearer {ui_keys['user']}"}) as api:  # fmt: skip
        for path, status in (("/v1/credits/999999999999999999999", 422), ("/v1/credits/abc", 422),
                             ("/v1/no-such-thing", 404), ("/v1/credits/999999", 404)):  # fmt: skip
            r = api.get(path)
            assert r.status_code == status and r.headers["content-type"] == "application/json", path
            assert r.json()["error"] in ("invalid_request", "not_found"), path
    # not signed in: the login page first, whatever the id
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.get("/ui/runs/999999999999999999999")
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/login")


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
