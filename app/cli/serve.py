"""``casi serve``: the REST API under uvicorn (`app.main:create_app`).

Read :func:`check_serve_settings`: every setting the API's start-up reads is checked before
uvicorn starts, so a bad one is one ``error:`` line and exit 2 (not a traceback out of the
server's start-up and uvicorn's exit 3).

The server then listens at once and builds what it needs in the background (`app.lifespan`,
`app.api.startup`): the log and `/readyz` say what it is doing (an index build or the default
policy's conversion takes minutes on a fresh var folder), and a SIGTERM stops it within seconds
in every phase. A start-up that fails stops the server: its error is the command's error (one
``error:`` line, exit 2 for what you can fix). With ``--workers N`` each worker process starts
on its own; one whose start-up failed keeps answering `/readyz` 503 with the failure.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from app.cli.common import check_policy_ref
from app.db.connect import connect
from app.runtime import preflight
from app.settings import Settings, get_settings
from app.training.policy_loader import DEFAULT_PREFIX, LATEST_WARMSTART
from evaluator.corpus import DatasetError

# On SIGTERM, requests in flight get this long to finish (queued generations included).
GRACEFUL_SHUTDOWN_S = 30
APP = "app.main:create_app"  # imported by uvicorn: the composition root is imported by nothing
STARTUP_FAILURE = 3  # uvicorn's exit status for a server that did not start (a port in use)
POLICY_ENV = "CASI_API_POLICY"


def _reads_database(ref: str | None) -> bool:
    """Does resolving ``ref`` read the registered versions (a version, a prefix, `warmstart`)?
    The default and folders do not: a database that is down does not stop them (start-up
    tolerates it, `/readyz` names it)."""
    if ref is None or not ref.strip() or ref.startswith(DEFAULT_PREFIX):
        return False
    try:
        return ref == LATEST_WARMSTART or not Path(ref).exists()
    except (OSError, ValueError):  # a NUL byte, a name too long: not a folder
        return True


def check_serve_settings() -> Settings:
    """The settings, checked in seconds with nothing heavy loaded: every CASI_* value and bound
    (CASI_API_PRECISION among them) as they are read, the var folder and the device, the dataset
    folder, and CASI_API_POLICY resolved as every ``--policy`` is (the database migrated first
    when CASI_API_MIGRATE, as start-up would)."""
    settings = get_settings()
    preflight(settings)
    if not Path(settings.dataset).is_dir():
        raise DatasetError("dataset folder not found", settings.dataset)
    ref = settings.api_policy
    if _reads_database(ref):
        with connect(settings, migrate=settings.api_migrate) as db:
            check_policy_ref(ref, db.factory, POLICY_ENV)
    else:
        check_policy_ref(ref, None, POLICY_ENV)
    return settings


def serve(
    host: Annotated[
        str, typer.Option(help="Interface to bind (0.0.0.0 in a container).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    workers: Annotated[
        int, typer.Option(min=1, help="Processes; each loads its own policy and index.")
    ] = 1,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve the REST API (rewrites, credits, policies, training jobs; docs at /docs).

    It listens at once; until start-up work (an index build, the default policy's conversion)
    has finished, /readyz answers 503 saying what it is doing."""
    check_serve_settings()
    import uvicorn  # lazy: only this command needs the server

    # uvicorn handles SIGTERM itself (graceful shutdown: the lifespan's exit stops the start-up
    # work and the embedded Redis), then raises it again to end the process with that signal:
    # the default action, not the CLI's unwinding (`app.cli.common.run_cli`)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    from app.api.startup import when_failed

    # forwarded headers: the app's own middleware, from CASI_API_TRUSTED_PROXIES only
    # (`app.main.create_app`); uvicorn's would trust 127.0.0.1 (FORWARDED_ALLOW_IPS) by default
    options: dict[str, Any] = dict(
        factory=True, host=host, port=port, log_level=log_level, proxy_headers=False,
        server_header=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )  # fmt: skip
    if workers > 1:  # each worker process builds its own app
        uvicorn.run(APP, workers=workers, **options)
        return
    server = uvicorn.Server(uvicorn.Config(APP, **options))
    failures: list[BaseException] = []

    def stop(error: BaseException) -> None:
        failures.append(error)
        server.should_exit = True

    when_failed(stop)
    server.run()  # after a SIGTERM it ends the process with that signal (uvicorn's way)
    if failures:
        raise failures[0]  # the error boundary prints it (one line, exit 2 when fixable)
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)
