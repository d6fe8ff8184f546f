"""FastAPI dependencies, as `Annotated` aliases: the app state, the caller, pagination.

Read :func:`principal`. A key comes as ``Authorization: Bearer <key>`` or ``X-API-Key``;
missing, unknown or revoked → 401, a user key on an admin endpoint → 403, over the key's rate
→ 429 with Retry-After. An address that sent too many wrong keys
(CASI_API_AUTH_FAILURES_PER_MIN) gets 429 before its key is even looked up. The key itself is never logged or echoed: only its prefix is known
past this point.
"""

from __future__ import annotations

import math
from typing import Annotated

import anyio
from fastapi import Depends, Path, Query, Request
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


def _missing_key() -> ApiError:
    return ApiError(401, "missing API key (Authorization: Bearer <key>)",
                    field="header.Authorization", headers=CHALLENGE)  # fmt: skip


async def key_present(request: Request) -> None:
    """401 for a request that carries no key, before any other dependency of the route (the
    authenticated routers include it first, `app.main.create_app`): a missing key is answered
    the same whether or not the server has finished starting. Whether the key is valid needs
    the database, so it is checked later, by :func:`principal`."""
    creds = await bearer(request)
    if not (creds.credentials if creds is not None else await header_key(request)):
        raise _missing_key()


KeyPresent = Depends(key_present)


async def principal(
    request: Request,
    state: State,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    x_api_key: Annotated[str | None, Depends(header_key)],
) -> Principal:
    key = creds.credentials if creds is not None else x_api_key
    if not key:
        raise _missing_key()
    address = request.client.host if request.client is not None else "?"
    wait = state.auth_failures.blocked(address)
    if wait > 0:
        raise ApiError(429, "too many failed authentications from this address",
                       field="header.Authorization",
                       headers={"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip
    who = await anyio.to_thread.run_sync(authenticate, state.factory, key, limiter=state.auth)
    if who is None:
        state.auth_failures.fail(address)
        raise ApiError(401, "invalid or revoked API key", field="header.Authorization",
                       headers=CHALLENGE)  # fmt: skip
    wait = state.limiter.take(who.key_id)
    if wait > 0:
        raise ApiError(429, f"rate limit of key {who.prefix}… exceeded",
                       field="header.Authorization",
                       headers={"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip
    return who


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
