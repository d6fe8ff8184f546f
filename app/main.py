"""`create_app()`: the CASI REST API (FastAPI). Run it with `casi serve` (uvicorn).

Read top to bottom: settings → FastAPI with the lifespan (`app.lifespan`, builds the heavy
components once) → error handlers (every error is JSON) → middleware (body cap, latency
metrics, CORS only when origins are configured) → one router per resource.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from app.api import errors
from app.api.middleware import BodyLimit, RequestMetrics
from app.api.routes import audits, credits, health, jobs, policies, rewrites
from app.lifespan import lifespan
from app.settings import Settings, get_settings

DESCRIPTION = """Rewrite serving with dynamic batching, exact Shapley credit per retrieval
action, policy versions and training jobs. Authenticate with `Authorization: Bearer <key>`
(create one with `casi keys create --scope user|admin`)."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="CASI",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.settings = settings
    errors.install(app)

    def current_metrics() -> Any:
        state = getattr(app.state, "casi", None)
        return None if state is None else state.metrics

    app.add_middleware(BodyLimit, max_bytes=settings.api_max_body_bytes)
    app.add_middleware(RequestMetrics, get_metrics=current_metrics)
    if settings.api_cors_origins:  # closed by default: no CORS headers at all
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.api_cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-API-Key"],
        )
    for module in (rewrites, credits, policies, jobs, audits, health):
        app.include_router(module.router)
    return app
