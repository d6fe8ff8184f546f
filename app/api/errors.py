"""Every error is JSON (`app.schemas.ErrorResponse`): a code, a message, the field at fault.

Read :func:`install`. Validation problems → 422 listing each field; the services' own
exceptions map to 404 / 409 / 422 / 503; a database that cannot be reached
(`OperationalError` / `InterfaceError`: connect failures, a dropped connection) → 503 with
Retry-After. A value the database refuses (`DataError`: out of range, a NUL byte) is the
caller's → 422; a constraint it breaks (`IntegrityError`) → 409. Anything unexpected → 500
with no detail (it is logged: a bug).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError, IntegrityError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from app.errors import (
    InvalidField,
    JobConflict,
    Overloaded,
    PolicyUnloadable,
    QueryConflict,
    UnknownPolicy,
)
from app.schemas import NO_NUL, NOT_BLANK, ErrorResponse

log = logging.getLogger("casi.api")
DB_RETRY_AFTER_S = 5
OVERLOAD_RETRY_AFTER_S = 1
HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
              405: "method_not_allowed", 409: "conflict", 413: "payload_too_large",
              415: "unsupported_media_type", 422: "invalid_request", 429: "rate_limited",
              503: "unavailable"}  # fmt: skip


ERROR_DESCRIPTIONS = {
    400: "The body could not be parsed (field: body).",
    401: "Missing, unknown or revoked API key (field: header.Authorization).",
    403: "The key's scope does not allow this (needs admin).",
    404: "No such resource (field names the path parameter, or the body field naming it).",
    409: "The resource is not in a state that allows this, or a limit of running jobs is reached.",
    413: "The body is larger than CASI_API_MAX_BODY_BYTES.",
    422: "A value is invalid or over a limit (field names it; problems lists every one).",
    429: "Over the key's rate, or too many failed authentications from this address "
    "(Retry-After says when to retry).",
    503: "The database is unreachable, the server is overloaded, or it is still starting "
    "(GET /readyz says what start-up is doing; Retry-After).",
}


def documented(*codes: int, **described: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, all with the one error model; a keyword
    ``s409="..."`` gives a status this route's own description."""
    json = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    return {
        c: {
            "model": ErrorResponse,
            "description": described.get(f"s{c}", ERROR_DESCRIPTIONS[c]),
            "content": json,
        }
        for c in codes
    }


# What every authenticated route can answer; routes add 403 / 404 / 409 / 413 as they apply.
AUTHENTICATED = (400, 401, 422, 429, 503)


class ApiError(Exception):
    """An error response: status, code, message, optional field and headers."""

    def __init__(
        self, status: int, message: str, *, field: str | None = None,
        headers: Mapping[str, str] | None = None, code: str | None = None,
    ) -> None:  # fmt: skip
        self.status, self.message, self.field = status, message, field
        self.code = code or HTTP_CODES.get(status, "error")
        self.headers = dict(headers or {})
        super().__init__(message)


def error_response(
    status: int, code: str, message: str, field: str | None = None,
    problems: list[dict[str, str]] | None = None, headers: Mapping[str, str] | None = None,
) -> JSONResponse:  # fmt: skip
    if problems is None:
        problems = [] if field is None else [{"field": field, "message": message}]
    body = {"error": code, "message": message, "field": field, "problems": problems}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def _loc(loc: Any) -> str:
    return ".".join(str(part) for part in loc)


def _problem(error: Mapping[str, Any]) -> dict[str, str]:
    loc, message = tuple(error.get("loc", ())), str(error.get("msg", ""))
    if error.get("type") == "json_invalid":  # loc is ("body", character offset)
        reason = (error.get("ctx") or {}).get("error", "")
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return {"field": "body", "message": f"invalid JSON{at}: {reason}".rstrip(": ")}
    if error.get("type") == "string_pattern_mismatch":
        pattern = (error.get("ctx") or {}).get("pattern")
        if pattern == NOT_BLANK:
            message = "must not be blank nor contain NUL characters"
        elif pattern == NO_NUL:
            message = "must not contain NUL characters"
    return {"field": _loc(loc), "message": message}


async def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [_problem(e) for e in exc.errors()]
    first = problems[0] if problems else {"field": "body", "message": "invalid request"}
    return error_response(
        422, "invalid_request", f"{first['field']}: {first['message']}", first["field"], problems
    )


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.message, exc.field, headers=exc.headers)


PROBED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(request: Request) -> list[str] | None:
    """Every method some route serves at this request's path, with OPTIONS (answered here);
    None when a route takes any method (a mounted app: its own answer stands).

    Starlette's 405 names only the methods of the first route that matched the path, and a
    path often has one route per method (`GET` and `POST /v1/audits`): each method is probed
    against the whole router instead.
    """
    routes = request.app.router.routes
    allowed = []
    for method in PROBED_METHODS:
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in routes):
            allowed.append(method)
    if len(allowed) == len(PROBED_METHODS):
        return None
    return [*allowed, "OPTIONS"] if allowed else None


async def _http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 405 and (allowed := allowed_methods(request)) is not None:
        headers["Allow"] = ", ".join(allowed)
        if request.method == "OPTIONS":  # the path exists: say what it serves (RFC 9110 §9.3.7)
            return Response(status_code=204, headers=headers)
    code = HTTP_CODES.get(exc.status_code, "error")
    field = {400: "body", 404: "path", 405: "path"}.get(exc.status_code)
    return error_response(exc.status_code, code, str(exc.detail), field, headers=headers)


async def _invalid_field(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidField)
    return error_response(422, "invalid_request", str(exc), exc.field)


async def _not_found(_: Request, exc: Exception) -> JSONResponse:
    message = str(exc.args[0]) if exc.args else "not found"  # KeyError's str() adds quotes
    field = getattr(exc, "field", None)
    return error_response(404, "not_found", message, field)


async def _conflict(_: Request, exc: Exception) -> JSONResponse:
    return error_response(409, "conflict", str(exc), getattr(exc, "field", None))


async def _overloaded(_: Request, exc: Exception) -> JSONResponse:
    headers = {"Retry-After": str(OVERLOAD_RETRY_AFTER_S)}
    return error_response(503, "overloaded", f"busy: {exc}; retry shortly", headers=headers)


def database_unavailable() -> JSONResponse:
    """The 503 of an unreachable database, with Retry-After."""
    headers = {"Retry-After": str(DB_RETRY_AFTER_S)}
    return error_response(503, "database_unavailable", "the database is unreachable; retry later",
                          "database", headers=headers)  # fmt: skip


async def _database(_: Request, exc: Exception) -> JSONResponse:
    log.warning("database unavailable: %s", type(exc).__name__)
    return database_unavailable()


async def _bad_value(_: Request, exc: Exception) -> JSONResponse:
    log.info("the database refused a value: %s", type(getattr(exc, "orig", exc)).__name__)
    return error_response(422, "invalid_request", "a value is out of the range the database "
                          "stores (numbers up to 2^31 - 1, text without NUL)", "body")  # fmt: skip


async def _integrity(_: Request, exc: Exception) -> JSONResponse:
    log.info("integrity error: %s", type(getattr(exc, "orig", exc)).__name__)
    return error_response(409, "conflict", "the request conflicts with stored data")


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error", exc_info=exc)
    return error_response(500, "internal_error", "internal error (logged)")


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(InvalidField, _invalid_field)
    app.add_exception_handler(UnknownPolicy, _not_found)
    app.add_exception_handler(LookupError, _not_found)
    app.add_exception_handler(JobConflict, _conflict)
    app.add_exception_handler(PolicyUnloadable, _conflict)
    app.add_exception_handler(QueryConflict, _conflict)
    app.add_exception_handler(Overloaded, _overloaded)
    app.add_exception_handler(OperationalError, _database)
    app.add_exception_handler(InterfaceError, _database)
    app.add_exception_handler(DataError, _bad_value)
    app.add_exception_handler(IntegrityError, _integrity)
    app.add_exception_handler(Exception, _unexpected)
