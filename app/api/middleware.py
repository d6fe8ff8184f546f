"""ASGI middleware: request-body cap (413 before the app reads anything) and latency metrics.

:class:`BodyLimit` reads the whole body first (bounded by the cap, a few tens of KiB) and
replays it to the app, so an oversized or lying ``Content-Length`` never reaches a route.
"""

from __future__ import annotations

import json
import time
from typing import Any

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


class RequestMetrics:
    """Latency histogram per (method, route template, status)."""

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
                metrics.latency.labels(scope["method"], path, str(status)).observe(
                    time.perf_counter() - start
                )
