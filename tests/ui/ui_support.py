"""Helpers of the dashboard tests: a uvicorn server in a thread, the settings it runs with."""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _app_conftest() -> Any:
    spec = importlib.util.spec_from_file_location(
        "casi_app_conftest_ui", ROOT / "tests/app/conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class UiServer:
    """uvicorn serving ``create_app(settings)`` in a daemon thread."""

    def __init__(self, settings: Any) -> None:
        import uvicorn

        from app.main import create_app

        self.app = create_app(settings)
        self.port = _free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> Any:
        return self.app.state.casi

    def start(self) -> UiServer:
        self.thread.start()
        deadline = time.monotonic() + float(os.environ.get("CASI_TEST_START_S", "180"))
        # it listens at once; the state is there once the start-up work has finished
        while not self.server.started or getattr(self.app.state, "casi", None) is None:
            startup = getattr(self.app.state, "startup", None)
            if startup is not None and startup.error is not None:
                raise RuntimeError(f"the UI test server's start-up failed: {startup.error!r}")
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the UI test server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def make_settings(var: Path, dataset: Path, database_url: str, redis_url: str, policy: Path) -> Any:
    from app.settings import Settings

    return Settings(
        var_dir=var, dataset=dataset, DATABASE_URL=database_url, REDIS_URL=redis_url,
        api_policy=str(policy), threads=2, api_max_new_tokens=24, device="cpu",
        api_rate_per_s=0, api_auth_failures_per_min=1000,
    )  # fmt: skip
