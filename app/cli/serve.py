"""``casi serve``: the REST API under uvicorn (`app.main:create_app`)."""

from __future__ import annotations

from typing import Annotated

import typer

# On SIGTERM, requests in flight get this long to finish (queued generations included).
GRACEFUL_SHUTDOWN_S = 30


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
    """Serve the REST API (rewrites, credits, policies, training jobs; docs at /docs)."""
    import uvicorn  # lazy: only this command needs the server

    uvicorn.run(
        "app.main:create_app", factory=True, host=host, port=port, workers=workers,
        log_level=log_level, proxy_headers=False, server_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )  # fmt: skip
