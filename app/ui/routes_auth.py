"""Login (an API key → a session cookie), logout, the dashboard's own static files."""

from __future__ import annotations

import secrets
from pathlib import Path

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.services.keys import authenticate
from app.ui import security
from app.ui.render import (
    UiCtx,
    UiError,
    app_state,
    checked_form,
    clear_session,
    page,
    read_form,
    redirect,
    signed_in,
)  # fmt: skip

router = APIRouter(prefix="/ui", include_in_schema=False)
STATIC = Path(__file__).parent / "static"
STATIC_FILES = {"ui.css": "text/css; charset=utf-8", "ui.js": "text/javascript; charset=utf-8"}


def _safe_next(target: str | None) -> str:
    """Only a path of this dashboard (never another site: no scheme, no '//')."""
    if (
        not target
        or not target.startswith("/ui")
        or target.startswith("/ui/login")
        or "//" in target
        or "\\" in target
    ):
        return "/ui/runs"
    return target


def _cookie(response: Response, request: Request, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name, value, max_age=max_age, path=security.COOKIE_PATH, httponly=True,
        samesite="strict", secure=request.url.scheme == "https",
    )  # fmt: skip


@router.get("")
async def home(ctx: UiCtx) -> Response:
    return redirect("/ui/runs")


@router.get("/login")
async def login_form(request: Request, next: str = "/ui/runs", ended: str = "") -> Response:
    """The login form; a signed-in caller (an active key) goes on to ``next``. A session that
    has ended (its key revoked, its token expired) is cleared here and the form says why, so
    a revoked key never bounces between a page and this one."""
    state = app_state(request)
    secret = security.secret_for(state.settings.var_dir)
    session, who, why = await signed_in(request, state)
    if session is not None and who is not None:
        return redirect(_safe_next(next))
    ended_message = security.SESSION_ENDED.get(why or ended)
    response = _login_page(request, secret, _safe_next(next), None, 200, ended_message)
    return clear_session(response) if why is not None else response


def _login_page(
    request: Request, secret: bytes, target: str, error: str | None, status: int,
    ended: str | None = None,
) -> Response:  # fmt: skip
    nonce = secrets.token_hex(16)
    response = page("login.html", None, status, next=target, error=error, ended=ended,
                    login_csrf=security.csrf_token(secret, nonce, "login"))  # fmt: skip
    _cookie(response, request, security.LOGIN_COOKIE, nonce, 1800)
    return response


@router.post("/login")
async def login(request: Request) -> Response:
    """Check the key once; on success a signed session cookie (never the key) and a redirect."""
    state = app_state(request)
    secret = security.secret_for(state.settings.var_dir)
    form = await read_form(request)
    target = _safe_next(form.get("next"))
    nonce = request.cookies.get(security.LOGIN_COOKIE)
    if not security.check_csrf(secret, nonce, form.get("csrf"), "login"):
        raise UiError(403, "missing or invalid CSRF token: reload the login page and try again")
    address = request.client.host if request.client is not None else "?"
    key = form.get("key", "").strip()
    # the attempt is taken before the look-up and given back if the key is valid, so
    # concurrent guesses cannot all pass (app.api.ratelimit.FailureLimiter)
    failures = state.auth_failures
    wait, taken = failures.attempt(address, key)
    if wait > 0:
        raise UiError(429, "too many failed authentications from this address; wait a minute")
    who = None
    try:
        if key:
            who = await anyio.to_thread.run_sync(
                authenticate, state.factory, key, limiter=state.auth
            )
    except BaseException:
        failures.settle(address, key, taken=taken, valid=None)  # the check failed, not the key
        raise
    failures.settle(address, key, taken=taken, valid=who is not None)
    if who is None:
        return _login_page(request, secret, target, "invalid or revoked API key", 401)
    response = redirect(target)
    _cookie(response, request, security.SESSION_COOKIE,
            security.issue_session(secret, who.key_id), security.COOKIE_TTL_S)  # fmt: skip
    response.delete_cookie(security.LOGIN_COOKIE, path=security.COOKIE_PATH)
    return response


@router.post("/logout")
async def logout(ctx: UiCtx) -> Response:
    await checked_form(ctx, admin=False)
    return clear_session(redirect("/ui/login"))


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC_FILES:
        raise UiError(404, "no such file")
    body = await anyio.Path(STATIC / name).read_bytes()
    return Response(body, media_type=STATIC_FILES[name],
                    headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})  # fmt: skip
