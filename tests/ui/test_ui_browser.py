"""The dashboard in a real headless browser (Debian's chromium + chromedriver, as the audit
report's browser test; `.ci/run` installs them): log in with a key, the runs table, a run's
curves, the credit explorer read against the database, a policy, an audit report, log out.
Screenshots of the run page and the explorer are written and checked (not blank); with
CASI_UI_SCREENSHOTS=docs/ui they refresh the README's images, otherwise they go to a temporary
folder (a test run leaves the working tree unchanged)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from browser_support import chromium_driver

from app.db import session_scope
from app.db.models import CreditRecord

ROOT = Path(__file__).resolve().parents[2]
SHOTS_ENV = "CASI_UI_SCREENSHOTS"


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    yield from chromium_driver(tmp_path_factory.mktemp("chromium-ui"), width=1360)


def _screenshot(driver: Any, path: Path) -> None:
    """The whole page as one PNG, checked not blank (ink and colours)."""
    from PIL import Image

    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(1360, min(4000, height + 40))
    path.parent.mkdir(parents=True, exist_ok=True)
    png = driver.get_screenshot_as_png()
    path.write_bytes(png)
    img = Image.open(io.BytesIO(png)).convert("RGB").resize((340, 250))
    pixels = list(img.getdata())
    ink = sum(1 for p in pixels if min(p) < 235) / len(pixels)
    assert path.stat().st_size > 30_000 and 0.05 < ink < 0.95 and len(set(pixels)) > 200, (
        path,
        ink,
    )
    driver.set_window_size(1360, 1000)


@pytest.mark.integration
def test_dashboard_in_headless_chromium(driver, ui_server, ui_keys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    shots = ROOT / os.environ[SHOTS_ENV] if os.environ.get(SHOTS_ENV) else tmp_path
    shots.mkdir(parents=True, exist_ok=True)

    srv, seeded = ui_server
    driver.get(srv.url + "/ui")
    assert "/ui/login" in driver.current_url  # not signed in → the login page
    driver.find_element(By.ID, "key").send_keys(ui_keys["user"])
    driver.find_element(By.ID, "login").click()
    # a form submit's navigation can outlast click(): wait for its path (the login page's own
    # URL, …/ui/login?next=/ui/runs, ends with "/ui/runs" too)
    WebDriverWait(driver, 30).until(lambda d: urlsplit(d.current_url).path == "/ui/runs")
    assert all(c["httpOnly"] for c in driver.get_cookies() if c["name"].startswith("casi_ui"))
    rows = driver.find_elements(By.CSS_SELECTOR, "#runs-table tr.run-row")
    assert {int(r.get_attribute("data-run")) for r in rows} >= {
        seeded.run_id,
        seeded.overlay_run_id,
    }

    # a run and its curves: SVG with data points
    driver.find_element(By.LINK_TEXT, "credit-shapley").click()
    assert f"/ui/runs/{seeded.run_id}" in driver.current_url
    for chart in ("chart-reward", "chart-gain", "chart-heldout-ndcg", "chart-heldout-recall", "chart-kl",
                  "chart-clip", "chart-format", "chart-accept", "chart-time"):  # fmt: skip
        svg = driver.find_element(By.ID, chart)
        assert svg.is_displayed() and len(svg.find_elements(By.CSS_SELECTOR, ".pt")) >= 3, chart
    reward = driver.find_elements(By.CSS_SELECTOR, "#chart-reward .pt")
    assert len(reward) == 2 * 30 and float(reward[29].get_attribute("data-x")) == 30
    # the two curves differ by more than colour: a marker shape each (coinciding runs stay visible)
    assert {p.get_attribute("data-marker") for p in reward[:30]} == {"circle"}
    assert {p.get_attribute("data-marker") for p in reward[30:]} == {"square"}
    _screenshot(driver, shots / "runs.png")

    # the credit explorer for the step, read against the database
    driver.find_element(By.LINK_TEXT, f"step {seeded.explorer_step}").click()
    with session_scope(srv.state.factory) as s:
        row = s.get(CreditRecord, seeded.credit_ids[0])
        assert row is not None
        phi, single, actions, qid, v_full = (
            list(row.credits),
            list(row.baselines["singleton"]),
            list(row.actions),
            row.query_id,
            row.value_full,
        )
    sample = driver.find_element(By.ID, f"sample-{seeded.credit_ids[0]}")
    cells = sample.find_elements(By.CSS_SELECTOR, "tr.action")
    assert len(cells) == len(actions)
    for j, tr in enumerate(cells):
        assert tr.find_element(By.CSS_SELECTOR, "td.rewrite").text == actions[j]
        assert float(
            tr.find_element(By.CSS_SELECTOR, "td.phi").get_attribute("data-value")
        ) == pytest.approx(phi[j], abs=1e-12)
        assert tr.find_element(By.CSS_SELECTOR, "td.phi").text == f"{phi[j]:+.3f}"
        assert float(
            tr.find_element(By.CSS_SELECTOR, "td.singleton").get_attribute("data-value")
        ) == pytest.approx(single[j], abs=1e-12)
    # rewrite 1 is the title of a relevant document: its hits include a relevant one, and each
    # hit's relevance is the qrels' and each hit is in that rewrite's own top-k
    retrieval = srv.state.retrieval
    judged = {d for split in retrieval.dataset.qrels.values() for d in split.get(qid, {})}
    own = retrieval.executor.run(actions[:1]).rows[0]
    own_ids = {retrieval.executor.retriever.doc_ids[r] for r in own if r >= 0}
    hits = cells[0].find_elements(By.CSS_SELECTOR, "span.hit")
    assert hits, "no hits shown for the first rewrite"
    for h in hits:
        doc = h.get_attribute("data-doc")
        assert doc in own_ids
        assert (h.get_attribute("data-relevant") == "True") == (doc in judged)
    assert any(h.get_attribute("data-relevant") == "True" for h in hits)
    # issue 27 item 6: broadcast beside the other three; each rewrite's own top-k, titles shown
    broadcast = [float(td.get_attribute("data-value") or "nan")
                 for td in sample.find_elements(By.CSS_SELECTOR, "td.broadcast")]  # fmt: skip
    assert broadcast == pytest.approx([v_full] * len(actions), abs=1e-12)
    titles = {d.doc_id: d.title for d in retrieval.dataset.documents}
    doc_ids = retrieval.executor.retriever.doc_ids
    first = sample.find_elements(By.CSS_SELECTOR, 'section.own[data-action="0"] li.own-hit')
    assert [li.get_attribute("data-doc") for li in first] == [doc_ids[r] for r in own if r >= 0]
    for li in first:
        title = li.find_element(By.CSS_SELECTOR, "span.title")
        assert title.is_displayed() and title.text == (
            titles[li.get_attribute("data-doc")] or "(no title)"
        )
        mark = li.find_element(By.CSS_SELECTOR, "span.mark").text
        assert mark == ("✓" if li.get_attribute("data-doc") in judged else "✗")
    assert driver.find_element(By.ID, "shaped-note").is_displayed()
    assert sample.find_elements(By.CSS_SELECTOR, f"#bars-{seeded.credit_ids[0]} g.bar")
    assert len(sample.find_elements(By.CSS_SELECTOR, f"#matrix-{seeded.credit_ids[0]} g.cell")) == 9
    assert driver.title != "pwned"  # the <script> rewrite on this page did not run
    _screenshot(driver, shots / "explorer.png")

    # the stored API credits, from the menu
    driver.find_element(By.LINK_TEXT, "API credits").click()
    driver.find_element(By.LINK_TEXT, str(seeded.api_credit_id)).click()
    WebDriverWait(driver, 10).until(
        lambda d: d.current_url.endswith(f"/ui/credits/{seeded.api_credit_id}")
    )
    assert driver.find_element(By.TAG_NAME, "h1").text == f"Credit record {seeded.api_credit_id}"

    # a policy, then an audit report embedded in its page
    driver.get(srv.url + f"/ui/policies/{seeded.ckpt_version}")
    lineage = driver.find_element(By.ID, "lineage").text
    assert seeded.warm_version[:12] in lineage
    assert not driver.find_elements(By.CSS_SELECTOR, "button.admin")  # a user key
    driver.get(srv.url + "/ui/audits")
    driver.find_element(By.LINK_TEXT, str(seeded.audit_id)).click()
    frame = driver.find_element(By.ID, "audit-report")
    driver.switch_to.frame(frame)
    assert driver.find_element(By.ID, "verdict").is_displayed()
    assert driver.find_elements(By.CSS_SELECTOR, "#plot-agreement svg")
    driver.switch_to.default_content()

    # log out → the login page, and /ui asks to log in again
    driver.find_element(By.ID, "logout").click()
    WebDriverWait(driver, 10).until(lambda d: "/ui/login" in d.current_url)
    driver.get(srv.url + "/ui/runs")
    assert "/ui/login" in driver.current_url
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []


@pytest.mark.integration
def test_a_revoked_key_in_chromium_lands_on_the_login_form(driver, ui_server) -> None:  # type: ignore[no-untyped-def]
    """Issue 27: after `casi keys revoke`, reloading a page looped 303 → /ui/login → 303 back
    (Chromium gives up with ERR_TOO_MANY_REDIRECTS). Now the reload shows the login form, says
    the key was revoked, and the session cookie is gone."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    from app.services.keys import create_key, revoke_key

    srv, _ = ui_server
    info, key = create_key(srv.state.factory, "browser-revoked", "user")
    driver.get(srv.url + "/ui/login")
    driver.delete_all_cookies()
    driver.get(srv.url + "/ui/login?next=/ui/jobs")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "login").click()
    # the path, not the URL's end: the login page's own URL (…/ui/login?next=/ui/jobs) ends
    # with "/ui/jobs" too, so an endswith wait passed before the login had happened
    WebDriverWait(driver, 30).until(lambda d: urlsplit(d.current_url).path == "/ui/jobs")
    assert any(c["name"] == "casi_ui" for c in driver.get_cookies())

    revoke_key(srv.state.factory, info.id)
    driver.refresh()
    WebDriverWait(driver, 15).until(lambda d: d.find_elements(By.ID, "login-form"))
    assert "/ui/login" in driver.current_url and "ended=revoked" in driver.current_url
    assert "API key was revoked" in driver.find_element(By.ID, "login-ended").text
    assert not any(c["name"] == "casi_ui" for c in driver.get_cookies())
    for path in ("/ui/runs", "/ui/login"):  # any page now: the form, no loop
        driver.get(srv.url + path)
        assert driver.find_elements(By.ID, "login-form"), path
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []
