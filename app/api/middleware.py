"""ASGI middleware: request-body cap (413 before the app reads anything) and latency metrics;
the router's trailing-slash redirect, relative (:func:`relative_slash_redirect`).

:class:`BodyLimit` reads the whole body first (bounded by the cap, a few tens of KiB) and
replays it to the app, so an oversized or lying ``Content-Length`` never reaches a route.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.responses import RedirectResponse
from starlette.routing import Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.metrics import Metrics


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await _too_large(send, self.max_bytes)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _too_large(send, self.max_bytes)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, sent = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps({
        "error": "payload_too_large",
        "message": f"request body over {limit} bytes",
        "field": "body",
        "problems": [{"field": "body", "message": f"at most {limit} bytes"}],
    }).encode()  # fmt: skip
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


STANDARD_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"}
)
"""The methods the latency histogram names; any other is counted as ``other``."""


def method_label(method: str) -> str:
    """A standard method as itself, anything else ``other``: the method is the client's to
    choose, so labelling by it as sent would add histogram series without bound."""
    return method if method in STANDARD_METHODS else "other"


class RequestMetrics:
    """Latency histogram per (method, route template, status): a bounded set of series (the
    standard methods and ``other``, the route templates and ``unmatched``)."""

    def __init__(self, app: ASGIApp, get_metrics: Any) -> None:
        self.app, self.get_metrics = app, get_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            metrics: Metrics | None = self.get_metrics()
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            if metrics is not None:
                metrics.latency.labels(method_label(scope["method"]), path, str(status)).observe(
                    time.perf_counter() - start
                )


def relative_slash_redirect(router: Router) -> ASGIApp:
    """The router's default app (no route matched): a path a route serves with the trailing
    slash added or removed is a 307 there, its ``Location`` relative (the path and the query,
    as the client sent them). Starlette's own redirect built an absolute URL from the ``Host``
    header, so ``Host: evil.example`` redirected to ``http://evil.example/…``. A target that
    would read as another host (``//host``, ``/\\host``) is not redirected: 404."""

    async def default(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/":
            path = scope["path"]
            other = path.rstrip("/") if path.endswith("/") else path + "/"
            raw = (scope.get("raw_path") or path.encode()).decode("latin-1")
            target = raw.rstrip("/") if raw.endswith("/") else raw + "/"
            probe = {**scope, "path": other}
            if (
                other
                and not target.startswith(("//", "/\\"))
                and any(route.matches(probe)[0] is not Match.NONE for route in router.routes)
            ):
                query = scope.get("query_string", b"").decode("latin-1")
                location = target + (f"?{query}" if query else "")
                await RedirectResponse(location, status_code=307)(scope, receive, send)
                return
        await router.not_found(scope, receive, send)

    return default
