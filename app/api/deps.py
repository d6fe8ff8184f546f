"""FastAPI dependencies, as `Annotated` aliases: the app state, the caller, pagination.

Read :func:`authorize`. A key comes as ``Authorization: Bearer <key>`` or ``X-API-Key``;
missing, unknown or revoked → 401, a user key on an admin endpoint → 403, over the key's rate
→ 429 with Retry-After. An address that sent too many wrong keys
(CASI_API_AUTH_FAILURES_PER_MIN) gets 429 before its key is even looked up; each look-up takes
its attempt first and gives it back once the key proved valid
(:class:`app.api.ratelimit.FailureLimiter`), so concurrent guesses cannot all pass the check.
Every `/v1` route is a :class:`KeyFirstRoute`: the key is checked before the route reads its
body (a malformed body is not answered before the key is); :func:`principal` reuses that
result. The key itself is never logged or echoed: only its prefix is known past this point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine, Mapping
from typing import Annotated, Any

import anyio
from fastapi import Depends, Path, Query, Request, Response
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from app.api.errors import ApiError
from app.api.startup import RETRY_AFTER_S
from app.api.state import AppState
from app.schemas import DB_INT_MAX
from app.services.keys import Principal, authenticate

bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer casi_...`")
header_key = APIKeyHeader(
    name="X-API-Key", auto_error=False, description="or `X-API-Key: casi_...`"
)


def built_state(request: Request) -> AppState | None:
    """The app's state once start-up has built it, else None."""
    state: AppState | None = getattr(request.app.state, "casi", None)
    return state


STARTING = "the server is still starting; retry shortly (GET /readyz says what it is doing)"
"""The 503 of every route but /readyz while start-up work runs: no dataset path, index version
or progress for a caller who may have no key (`/readyz`, meant for load balancers and
monitoring, says what start-up is doing)."""
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def get_state(request: Request) -> AppState:
    """The built state; while the server is still starting, 503 (:data:`STARTING`) with
    Retry-After."""
    state = built_state(request)
    if state is None:
        raise ApiError(503, STARTING, code="starting",
                       headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
    return state


State = Annotated[AppState, Depends(get_state)]


def missing_key() -> ApiError:
    return ApiError(401, "missing API key (Authorization: Bearer <key>)",
                    field="header.Authorization", headers=CHALLENGE)  # fmt: skip


async def key_present(request: Request) -> None:
    """401 for a request that carries no key, before any other dependency of the route (the
    authenticated routers include it first, `app.main.create_app`): a missing key is answered
    the same whether or not the server has finished starting. Whether the key is valid needs
    the database, so it is checked later, by :func:`principal`."""
    creds = await bearer(request)
    if not (creds.credentials if creds is not None else await header_key(request)):
        raise missing_key()


KeyPresent = Depends(key_present)


PRINCIPAL_SCOPE_KEY = "casi.principal"
"""Where :class:`KeyFirstRoute` leaves the checked caller in the ASGI scope."""


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries (``Authorization: Bearer`` first, then ``X-API-Key``), or
    None; what :func:`principal`'s two security schemes read, without a Request."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token:
        return token
    return headers.get("x-api-key") or None


async def authorize(state: AppState, key: str, address: str) -> Principal:
    """THE key check: the address's wrong-key limit (an attempt taken before the look-up,
    given back when the key is valid: :class:`app.api.ratelimit.FailureLimiter`), the look-up
    (401 unknown or revoked), then the key's own rate (429). Raises :class:`ApiError`; a
    database error propagates (503 by the handlers), its attempt given back."""
    failures = state.auth_failures
    wait, taken = failures.attempt(address, key)
    if wait > 0:
        raise ApiError(429, "too many failed authentications from this address",
                       field="header.Authorization",
                       headers={"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip
    try:
        who = await anyio.to_thread.run_sync(authenticate, state.factory, key, limiter=state.auth)
    except BaseException:
        failures.settle(address, key, taken=taken, valid=None)  # the check failed, not the key
        raise
    failures.settle(address, key, taken=taken, valid=who is not None)
    if who is None:
        raise ApiError(401, "invalid or revoked API key", field="header.Authorization",
                       headers=CHALLENGE)  # fmt: skip
    wait = state.limiter.take(who.key_id)
    if wait > 0:
        raise ApiError(429, f"rate limit of key {who.prefix}… exceeded",
                       field="header.Authorization",
                       headers={"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip
    return who


def client_address(request: Request) -> str:
    return request.client.host if request.client is not None else "?"


class KeyFirstRoute(APIRoute):
    """A route that checks the caller's key before anything else of the request: FastAPI
    reads and parses the body (a malformed one is a 422) before it solves any dependency, so
    a bad body skipped the key check, the wrong-key count and the key's rate limit. Here: no
    key → 401; once the server has started, the whole check (:func:`authorize`) → 401 / 429,
    else the caller is left in the scope for :func:`principal`; then the route as FastAPI runs
    it. Before start-up has finished a request with a key goes on (the route's 503
    ``starting``). Errors raised here go to the app's handlers (JSON; a database outage 503).
    404, 405 and OPTIONS never reach a route: the router answers them as before."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def key_first(request: Request) -> Response:
            key = presented_key(request.headers)
            if key is None:
                raise missing_key()
            state = built_state(request)
            if state is not None:
                checked = await authorize(state, key, client_address(request))
                request.scope[PRINCIPAL_SCOPE_KEY] = checked
            return await handler(request)

        return key_first


async def principal(
    request: Request,
    state: State,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    x_api_key: Annotated[str | None, Depends(header_key)],
) -> Principal:
    checked = request.scope.get(PRINCIPAL_SCOPE_KEY)
    if isinstance(checked, Principal):  # KeyFirstRoute checked this request's key already
        return checked
    key = creds.credentials if creds is not None else x_api_key
    if not key:
        raise missing_key()
    return await authorize(state, key, client_address(request))


User = Annotated[Principal, Depends(principal)]


async def admin(who: User) -> Principal:
    if not who.is_admin:
        raise ApiError(403, f"key {who.prefix}… has scope {who.scope!r}; this needs 'admin'",
                       field="header.Authorization")  # fmt: skip
    return who


Admin = Annotated[Principal, Depends(admin)]
# Integers that reach the database are bounded to its range (app.schemas.DB_INT_MAX: ids and
# offsets are int4 columns on PostgreSQL), so 2^31 or more is a 422 here, never a database error.
Limit = Annotated[int, Query(ge=1, le=100, description="Page size.")]
Offset = Annotated[int, Query(ge=0, le=DB_INT_MAX, description="Items to skip.")]
RecordId = Annotated[int, Path(ge=1, le=DB_INT_MAX, description="A stored record's id.")]
# Policy versions are content hashes (hex); a unique prefix of ≥ 6 characters also names one.
VersionRef = Annotated[
    str,
    Path(
        min_length=6, max_length=64, pattern=r"^[0-9a-f]+$",
        description="A policy version (hex content hash) or a unique prefix of ≥ 6 characters.",
    ),
]  # fmt: skip
