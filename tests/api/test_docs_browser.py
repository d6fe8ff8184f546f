"""`/docs` and `/redoc` in a real headless chromium with the network cut off: every asset is
served by the app itself (fastapi-offline), so Swagger UI and ReDoc render every operation.

The browser resolves every host except 127.0.0.1 to nothing and sends anything not on loopback
to a closed proxy port, so a page that still loaded a CDN script would render blank. The app is
the real ``create_app`` served by uvicorn in a thread with the lifespan off (the docs need no
model, index or database), which keeps this test to a few seconds beyond the browser start.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from browser_support import chromium_driver

from app.main import create_app
from app.settings import Settings

NETWORK_OFF = (
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--proxy-server=http://127.0.0.1:9",  # loopback bypasses it; anything else fails
)


@pytest.fixture(scope="module")
def docs_url() -> Iterator[str]:
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(
        uvicorn.Config(create_app(Settings()), host="127.0.0.1", port=port, lifespan="off",
                       log_level="warning")
    )  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from chromium_driver(tmp_path_factory.mktemp("chromium-docs"), 1280, NETWORK_OFF)


def _operations(docs_url: str) -> set[tuple[str, str]]:
    import httpx

    spec = httpx.get(docs_url + "/openapi.json", timeout=30).json()
    return {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}


@pytest.mark.integration
def test_network_is_really_off(driver: Any) -> None:
    """The flags work: an outside address does not load (so the checks below mean something)."""
    from selenium.common.exceptions import WebDriverException

    with pytest.raises(WebDriverException, match="ERR_"):
        driver.get("https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css")


@pytest.mark.integration
def test_swagger_ui_renders_every_operation_offline(driver: Any, docs_url: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    expected = _operations(docs_url)
    driver.get(docs_url + "/docs")
    WebDriverWait(driver, 60).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, ".opblock")) >= len(expected)
    )
    shown = {
        (
            b.find_element(By.CSS_SELECTOR, ".opblock-summary-method").text.strip().upper(),
            b.find_element(By.CSS_SELECTOR, ".opblock-summary-path").get_attribute("data-path"),
        )
        for b in driver.find_elements(By.CSS_SELECTOR, ".opblock")
    }
    assert shown == expected
    assert ("POST", "/v1/credits") in shown
    origins = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => new URL(e.name).origin)"
    )
    assert origins and set(origins) == {docs_url}, origins


@pytest.mark.integration
def test_redoc_renders_offline(driver: Any, docs_url: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    driver.get(docs_url + "/redoc")
    WebDriverWait(driver, 60).until(
        lambda d: "/v1/credits" in d.find_element(By.TAG_NAME, "body").text
    )
    origins = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => new URL(e.name).origin)"
    )
    assert set(origins) == {docs_url}, origins
