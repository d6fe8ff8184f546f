"""The HTML audit report in a real headless browser (Debian's chromium + chromedriver, which
`.ci/run` installs when missing): it renders offline from file://, every plot is present and
visibly drawn in a screenshot, and the console has no errors."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from browser_support import chromium_driver

from app.reports.audit_html import render_html
from app.reports.audit_json import build_report, validate_report
from evaluator.audit import AuditConfig, Games, audit

PLOTS = ("plot-agreement", "plot-delta", "plot-phi", "plot-cheap")


def _report() -> dict[str, Any]:
    """Reference = training + noise, m = 4 (some rollouts with 2-3 actions): every section
    has content (passing and failing sizes, ties, cheap-credit rows for m = 2, 3, 4)."""
    gen = torch.Generator().manual_seed(3)
    n = 120
    ref = torch.rand(n, 16, generator=gen, dtype=torch.float64).round(decimals=1)
    train = ref + 0.25 * torch.randn(n, 16, generator=gen, dtype=torch.float64) * torch.arange(
        16
    ).div(15)
    n_actions = torch.tensor([4, 4, 3, 2] * (n // 4))
    result = audit(Games(train, ref, n_actions, torch.arange(n) // 4), AuditConfig(n_boot=200))
    return build_report(
        result, train={"name": "surrogate", "version": "abc"}, reference={"name": "replay", "version": "def"},
        meta={"source": "sampled", "policy_version": "p1", "split": "test", "anchor_query": True},
    )  # fmt: skip


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    yield from chromium_driver(tmp_path_factory.mktemp("chromium-profile"), width=1280)


def _ink(png: bytes, box: dict[str, float], scale: float) -> tuple[float, int]:
    """(share of non-white pixels, number of distinct colours) inside ``box`` of a screenshot."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    left, top = int(box["x"] * scale), int(box["y"] * scale)
    crop = img.crop((left, top, left + int(box["width"] * scale), top + int(box["height"] * scale)))
    pixels = list(crop.getdata())
    ink = sum(1 for p in pixels if min(p) < 235) / max(1, len(pixels))
    return ink, len(set(pixels))


@pytest.mark.integration
def test_report_renders_in_headless_chromium(driver, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    report = _report()
    validate_report(report)
    assert report["verdict"] in ("partial", "disagrees")  # the noise grows with coalition size
    html = render_html(report)
    # self-contained: no scripts, stylesheets, remote images, fonts or imports to fetch
    # (in-document references such as url(#clip) and href="#glyph" are fine)
    assert not re.search(
        r"<script|<link|<img|<iframe|@import|url\((?!#)|(src|href)\s*=\s*\"(?!#)", html
    )
    assert "http" not in re.sub(r'xmlns(:\w+)?="http://www\.w3\.org/[^"]*"', "", html)
    page = tmp_path / "audit.html"
    page.write_text(html, encoding="utf-8")

    driver.get(page.as_uri())
    assert driver.title == "CASI audit: surrogate vs replay"
    verdict = driver.find_element(By.ID, "verdict")
    assert verdict.is_displayed() and report["verdict"] in verdict.text.lower()
    assert report["summary"][:60] in verdict.text
    rows = driver.find_elements(By.CSS_SELECTOR, "#size-table tr")
    assert len(rows) == 1 + 4  # header + sizes 1..4

    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, int(height) + 200)  # the whole page in one screenshot
    scale = float(driver.execute_script("return window.devicePixelRatio"))
    png = driver.get_screenshot_as_png()
    for plot_id in PLOTS:
        svg = driver.find_element(By.CSS_SELECTOR, f"#{plot_id} svg")
        assert svg.is_displayed(), plot_id
        box = {**svg.location, **svg.size}
        assert box["width"] > 300 and box["height"] > 150, (plot_id, box)
        ink, colours = _ink(png, box, scale)
        assert 0.02 < ink < 0.9 and colours > 20, (plot_id, ink, colours)  # drawn, not blank

    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []
