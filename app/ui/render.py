"""Templates, the request context of every dashboard page, forms and errors.

Read :func:`ui_context` (the session → the caller, or a redirect to the login page) and
:func:`page` (a template rendered with autoescape on and the security headers). Jinja's
autoescape escapes every string a template prints — rewrites, queries, logs, names — so a
rewrite ``<script>…`` is shown as text; only the project's own SVG (:mod:`app.ui.svg`, which
escapes its labels) is inserted with ``|safe``.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from http import HTTPStatus
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from app.api.startup import RETRY_AFTER_S
from app.api.state import AppState
from app.services.keys import Principal
from app.ui import security
from app.ui.colour import NEUTRAL_BELOW, colour_scale, credit_class

TEMPLATES = Path(__file__).parent / "templates"
MAX_FORM_BYTES = 16_384
MAX_FORM_FIELDS = 64  # the job form, the largest, has about 20
env = Environment(
    loader=FileSystemLoader(TEMPLATES), autoescape=True, undefined=StrictUndefined,
    trim_blocks=True, lstrip_blocks=True,
)  # fmt: skip


def fmt(v: Any, digits: int = 4) -> str:
    """A value as the dashboard prints it: numbers to ``digits`` significant digits (:func:`num`),
    booleans as yes / no, None and non-finite numbers as —."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        return num(v, digits)
    return str(v)


def num(v: float, digits: int = 4) -> str:
    """``digits`` significant digits, never a fixed number of decimals, so a learning rate of
    1e-05, a gradient norm of 2.9e-09 and a loss of 4.6e-18 keep their value (``.4f`` printed
    all three as 0.0000): 0 is 0, an integer stays whole, a magnitude from 10^digits up to 10^6
    is rounded to a whole number, smaller than 1e-4 or from 10^6 up is in scientific notation."""
    if v == 0:
        return "0"
    if isinstance(v, int) and abs(v) < 10**15:
        return str(v)
    if 10**digits <= abs(v) < 1e6:
        return f"{v:.0f}"
    return f"{v:.{digits}g}"


def signed(v: Any, digits: int = 3) -> str:
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        return "—"
    return f"{float(v):+.{digits}f}"


def when(v: datetime | None) -> str:
    return "—" if v is None else v.strftime("%Y-%m-%d %H:%M:%S")


env.filters.update(fmt=fmt, num=num, signed=signed, when=when)
env.globals.update(
    credit_class=credit_class, colour_scale=colour_scale, neutral_below=NEUTRAL_BELOW, zip=zip,
    enumerate=enumerate,
)  # fmt: skip


class LoginRequired(Exception):
    """No valid session: the handler redirects to the login page. ``reason`` (a key of
    :data:`app.ui.security.SESSION_ENDED`) when the request carried a session that has ended:
    the handler then clears the cookie and the login page says why."""

    def __init__(self, next_path: str = "/ui", reason: str | None = None) -> None:
        self.next_path, self.reason = next_path, reason
        super().__init__(next_path)


class UiError(Exception):
    """An error page (403 admin only / bad CSRF, 404, 409, 422, 429, 503 while starting);
    ``retry_after`` seconds: a Retry-After header, and the page reloads itself after them."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        self.status, self.message, self.retry_after = status, message, retry_after
        super().__init__(message)


@dataclass
class Ctx:
    request: Request
    state: AppState
    who: Principal
    nonce: str
    csrf: str

    @property
    def secret(self) -> bytes:
        return security.secret_for(self.state.settings.var_dir)

    @property
    def served_version(self) -> str | None:
        batcher = getattr(self.state, "batcher", None)
        return None if batcher is None else str(batcher.policy.version)


def app_state(request: Request) -> AppState:
    """The built state; while start-up work runs, a 503 page that reloads itself every few
    seconds. It does not say what start-up is doing (the dataset, the index, the progress): the
    caller is not signed in yet; `/readyz` says it."""
    state: AppState | None = getattr(request.app.state, "casi", None)
    if state is None:
        raise UiError(503, "The server is still starting. This page reloads itself until it "
                      "is ready.", retry_after=RETRY_AFTER_S)  # fmt: skip
    return state


async def signed_in(
    request: Request, state: AppState
) -> tuple[security.UiSession | None, Principal | None, str | None]:
    """The request's session and its active key; (None, None, why) without one, ``why`` None
    when no session cookie came, else a key of :data:`app.ui.security.SESSION_ENDED`."""
    secret = security.secret_for(state.settings.var_dir)
    session, why = security.session_state(secret, request.cookies.get(security.SESSION_COOKIE))
    if session is None:
        return None, None, why
    who = await state.run_read(security.principal_by_id, state.factory, session.key_id)
    if who is None:
        return None, None, "revoked"
    return session, who, None


def clear_session(response: Response) -> Response:
    """Delete the session cookie (logout, or a session that has ended)."""
    response.delete_cookie(security.SESSION_COOKIE, path=security.COOKIE_PATH,
                           httponly=True, samesite="strict")  # fmt: skip
    return response


async def ui_context(request: Request) -> Ctx:
    """The signed-in caller (the session cookie → its active key), rate-limited like the
    REST API; no valid session → LoginRequired."""
    state = app_state(request)
    secret = security.secret_for(state.settings.var_dir)
    session, who, reason = await signed_in(request, state)
    if session is None or who is None:
        raise LoginRequired(request.url.path, reason)
    if state.limiter.take(who.key_id) > 0:
        raise UiError(429, f"rate limit of key {who.prefix}… exceeded; try again shortly")
    return Ctx(request, state, who, session.nonce, security.csrf_token(secret, session.nonce))


UiCtx = Annotated[Ctx, Depends(ui_context)]


async def read_form(request: Request) -> dict[str, str]:
    """An application/x-www-form-urlencoded body as {field: last value} (bounded)."""
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise UiError(413, "form too large")
    if request.headers.get("content-type", "").split(";")[0].strip() not in (
        "application/x-www-form-urlencoded", "",
    ):  # fmt: skip
        raise UiError(415, "forms are posted as application/x-www-form-urlencoded")
    try:
        parsed = parse_qs(
            body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS
        )
    except ValueError:  # parse_qs's refusal of more than max_num_fields
        raise UiError(400, f"too many form fields (at most {MAX_FORM_FIELDS})") from None
    return {k: v[-1] for k, v in parsed.items()}


async def checked_form(ctx: Ctx, *, admin: bool) -> dict[str, str]:
    """The posted form, after the CSRF check (and the admin scope when asked): 403 otherwise."""
    form = await read_form(ctx.request)
    if not security.check_csrf(ctx.secret, ctx.nonce, form.get("csrf")):
        raise UiError(403, "missing or invalid CSRF token: reload the page and try again")
    if admin and not ctx.who.is_admin:
        raise UiError(403, f"key {ctx.who.prefix}… has scope {ctx.who.scope!r}; this needs 'admin'")
    return form


def page(name: str, ctx: Ctx | None, status: int = 200, **values: Any) -> HTMLResponse:
    """Render ``templates/<name>`` with the caller, the CSRF token and the security headers."""
    who = ctx.who if ctx else None
    html = env.get_template(name).render(
        who=who, is_admin=bool(who and who.is_admin), csrf=ctx.csrf if ctx else "", **values
    )
    return HTMLResponse(html, status_code=status, headers=security.security_headers())


def redirect(path: str) -> RedirectResponse:
    return RedirectResponse(path, status_code=303, headers=security.security_headers())


async def login_required_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginRequired)
    target = exc.next_path if request.method == "GET" and exc.next_path.startswith("/ui") else "/ui"
    if exc.reason is None:
        return redirect(f"/ui/login?next={quote(target, safe='/')}")
    return clear_session(redirect(f"/ui/login?next={quote(target, safe='/')}&ended={exc.reason}"))


def error_page(
    status: int, message: str, problems: list[str] | None = None, retry_after: int | None = None
) -> HTMLResponse:
    """The dashboard's error page: the status, the message (every problem when several), a
    link back; with ``retry_after``, a Retry-After header and a reload after that many
    seconds."""
    out = page("error.html", None, status, code=status, phrase=_phrase(status), message=message,
               problems=problems if problems and len(problems) > 1 else [],
               refresh=retry_after)  # fmt: skip
    if retry_after is not None:
        out.headers["Retry-After"] = str(retry_after)
    return out


async def ui_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, UiError)
    return error_page(exc.status, exc.message, retry_after=exc.retry_after)


def is_ui_path(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


Handler = Callable[[Request, Exception], Any]


def html_under_ui(handler: Handler) -> Callable[[Request, Exception], Awaitable[Response]]:
    """``handler`` (one of the REST API's JSON error handlers, `app.api.errors`) unchanged
    outside ``/ui``; under ``/ui`` its answer as the error page: same status, its message
    (and every problem of a validation error, the field named without its location prefix),
    its headers (Retry-After, Allow) kept."""

    async def wrapped(request: Request, exc: Exception) -> Response:
        response = handler(request, exc)
        if inspect.isawaitable(response):
            response = await response
        assert isinstance(response, Response)
        if not is_ui_path(request.url.path):
            return response
        message, problems = _error_text(getattr(response, "body", b""), response.status_code)
        out = error_page(response.status_code, message, problems)
        for name, value in response.headers.items():
            if name.lower() not in ("content-type", "content-length") and name not in out.headers:
                out.headers[name] = value
        return out

    return wrapped


def _error_text(body: Any, status: int) -> tuple[str, list[str]]:
    """The message and problems of a JSON error body (``app.schemas.ErrorResponse``, or
    FastAPI's ``{"detail": ...}``)."""
    try:
        data = json.loads(bytes(body))
    except (ValueError, TypeError):
        data = None
    if not isinstance(data, dict):
        return _phrase(status) or "error", []
    problems = [
        f"{_field(p.get('field'))}: {p.get('message', '')}".lstrip(": ")
        for p in data.get("problems") or [] if isinstance(p, dict)
    ]  # fmt: skip
    message = data.get("message") or data.get("detail") or "error"
    if problems:
        message = problems[0]
    return str(message), problems


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _field(field: Any) -> str:
    """A validation field without its location: ``path.run_id`` → ``run_id``."""
    text = str(field or "")
    head, _, rest = text.partition(".")
    return rest if head in ("path", "query", "body", "header", "cookie") and rest else text


def pages(total: int, per_page: int, page_no: int) -> dict[str, Any]:
    """Pagination of ``total`` items: current page, last page, previous/next or None."""
    last = max(0, math.ceil(total / per_page) - 1)
    return {"page": page_no, "last": last, "total": total, "per": per_page,
            "prev": page_no - 1 if page_no > 0 else None,
            "next": page_no + 1 if page_no < last else None}  # fmt: skip
