"""Headless Debian chromium for the browser tests (the audit report, the dashboard): one place
that finds the binaries (skipping with the reason when they are missing) and starts a driver
with the flags this closed network needs."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
)  # fmt: skip


def chromium_driver(profile: Path, width: int, extra_flags: tuple[str, ...] = ()) -> Iterator[Any]:
    """Yield a selenium Chrome driver (window ``width`` × 1000, profile folder ``profile``;
    ``extra_flags`` added to :data:`FLAGS`)."""
    missing = [
        p
        for p in (CHROMIUM, CHROMEDRIVER)
        if not Path(p).exists() and not shutil.which(Path(p).name)
    ]
    if missing:
        pytest.skip(f"{missing} not installed (`.ci/run` installs chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, *extra_flags, f"--window-size={width},1000", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()
