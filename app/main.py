"""`create_app()`: the CASI REST API (FastAPI). Run it with `casi serve` (uvicorn).

Read top to bottom: settings → FastAPI with the lifespan (`app.lifespan`, builds the heavy
components once) → error handlers (every error is JSON) → middleware (body cap, latency
metrics, CORS only when origins are configured, forwarded headers believed only from
CASI_API_TRUSTED_PROXIES) → one router per resource → the OpenAPI,
which states this server's limits (queries per request, characters per query) and the
evaluators it has, so the contract is what the server enforces.

`/docs` (Swagger UI) and `/redoc` load their assets from this server (`fastapi-offline`
ships them): the docs work with no network. ReDoc's bundle hard-codes one image on its CDN (the
"API docs by Redocly" logo), so `/redoc` is ours: the same page and bundle with that address
replaced by the local favicon.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, Response
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from app.api import errors
from app.api.deps import KeyPresent
from app.api.middleware import BodyLimit, RequestMetrics, relative_slash_redirect
from app.api.routes import audits, credits, health, jobs, policies, rewrites
from app.lifespan import lifespan
from app.schemas import EVALUATORS
from app.settings import Settings, get_settings
from app.ui import install as install_ui

DESCRIPTION = """Rewrite serving with dynamic batching, exact Shapley credit per retrieval
action, policy versions and training jobs. Authenticate with `Authorization: Bearer <key>`
(create one with `casi keys create --scope user|admin`)."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPIOffline(
        title="CASI",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        redoc_url=None,  # ours below: offline all the way
    )
    app.state.settings = settings
    app.router.redirect_slashes = False  # ours: relative, never built from the Host header
    app.router.default = relative_slash_redirect(app.router)
    _install_redoc(app)
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
    if settings.api_trusted_proxies:  # outermost: every layer sees the real client and scheme
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=settings.api_trusted_proxies)
    for module in (rewrites, credits, policies, jobs, audits):  # every route needs a key:
        app.include_router(module.router, dependencies=[KeyPresent])  # 401 first, even starting
    app.include_router(health.router)
    install_ui(app)  # the web dashboard under /ui (app/ui/)
    app.openapi = lambda: _openapi(app, settings)  # type: ignore[method-assign]
    return app


OFFLINE_STATIC = "/static-offline-docs"  # where fastapi-offline mounts its assets
REDOC_CDN_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"


@functools.cache
def _redoc_bundle() -> bytes:
    """fastapi-offline's ReDoc bundle with its one CDN image pointed at the local favicon."""
    path = Path(fastapi_offline.__file__).parent / "static" / "redoc.standalone.js"
    text = path.read_text(encoding="utf-8")
    return text.replace(REDOC_CDN_LOGO, f"{OFFLINE_STATIC}/favicon.png").encode()


def _install_redoc(app: FastAPI) -> None:
    @app.get("/redoc-assets/redoc.standalone.js", include_in_schema=False)
    async def redoc_js() -> Response:
        return Response(_redoc_bundle(), media_type="text/javascript",
                        headers={"Cache-Control": "public, max-age=3600"})  # fmt: skip

    @app.get("/redoc", include_in_schema=False)
    async def redoc_html() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - ReDoc",
            redoc_js_url="/redoc-assets/redoc.standalone.js", with_google_fonts=False,
            redoc_favicon_url=f"{OFFLINE_STATIC}/favicon.png",
        )  # fmt: skip


def _openapi(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """The generated schema with this server's settings and evaluators filled in (cached once
    the lifespan has built the state, so the evaluators are known)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)  # fmt: skip
    models = schema["components"]["schemas"]
    _restore_examples(models)
    queries = models["RewriteRequest"]["properties"]["queries"]
    queries["maxItems"] = settings.api_max_queries
    queries["items"]["maxLength"] = settings.api_max_query_chars
    state = getattr(app.state, "casi", None)
    if state is not None:
        available = [name for name in EVALUATORS if name in state.scorers]
        for model in models.values():
            for prop in model.get("properties", {}).values():
                _narrow_enum(prop, set(EVALUATORS), available)
        app.openapi_schema = schema
    return schema


def _app_models() -> dict[str, type[BaseModel]]:
    """The pydantic models defined under app/, by name (a name two of them share is left out)."""
    found: dict[str, list[type[BaseModel]]] = {}
    stack = list(BaseModel.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith("app."):
            found.setdefault(cls.__name__, []).append(cls)
    return {name: classes[0] for name, classes in found.items() if len(set(classes)) == 1}


def _restore_examples(components: dict[str, Any]) -> None:
    """Put back the nulls of each model's examples: FastAPI writes the OpenAPI without None
    values, so an example's `"run_id": null` disappeared and the example broke its own schema
    (a required field missing)."""
    classes = _app_models()
    for name, component in components.items():
        cls = classes.get(name)
        if cls is None or "examples" not in component:
            continue
        examples = cls.model_json_schema().get("examples")
        if examples is not None:
            component["examples"] = examples


def _narrow_enum(node: dict[str, Any], full: set[str], available: list[str]) -> None:
    """Replace an enum of every evaluator by the available ones (inside anyOf too)."""
    if set(node.get("enum", ())) == full:
        node["enum"] = list(available)
    for sub in node.get("anyOf", ()):
        _narrow_enum(sub, full, available)
