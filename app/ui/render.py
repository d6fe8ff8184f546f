"""Templates, the request context of every dashboard page, forms and errors.

Read :func:`ui_context` (the session → the caller, or a redirect to the login page) and
:func:`page` (a template rendered with autoescape on and the security headers). Jinja's
autoescape escapes every string a template prints — rewrites, queries, logs, names — so a
rewrite ``<script>…`` is shown as text; only the project's own SVG (:mod:`app.ui.svg`, which
escapes its labels) is inserted with ``|safe``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from app.api.state import AppState
from app.services.keys import Principal
from app.ui import security
from app.ui.colour import NEUTRAL_BELOW, colour_scale, credit_class

TEMPLATES = Path(__file__).parent / "templates"
MAX_FORM_BYTES = 16_384
env = Environment(
    loader=FileSystemLoader(TEMPLATES), autoescape=True, undefined=StrictUndefined,
    trim_blocks=True, lstrip_blocks=True,
)  # fmt: skip


def fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        return f"{float(v):.{digits}f}"
    return str(v)


def signed(v: Any, digits: int = 3) -> str:
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        return "—"
    return f"{float(v):+.{digits}f}"


def when(v: datetime | None) -> str:
    return "—" if v is None else v.strftime("%Y-%m-%d %H:%M:%S")


env.filters.update(fmt=fmt, signed=signed, when=when)
env.globals.update(
    credit_class=credit_class, colour_scale=colour_scale, neutral_below=NEUTRAL_BELOW, zip=zip,
    enumerate=enumerate,
)  # fmt: skip


class LoginRequired(Exception):
    """No valid session: the handler redirects to the login page."""

    def __init__(self, next_path: str = "/ui") -> None:
        self.next_path = next_path
        super().__init__(next_path)


class UiError(Exception):
    """An error page (403 admin only / bad CSRF, 404, 409, 422, 429)."""

    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message
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
    state: AppState | None = getattr(request.app.state, "casi", None)
    if state is None:
        raise UiError(503, "the server is still starting")
    return state


async def ui_context(request: Request) -> Ctx:
    """The signed-in caller (the session cookie → its active key), rate-limited like the
    REST API; no valid session → LoginRequired."""
    state = app_state(request)
    secret = security.secret_for(state.settings.var_dir)
    session = security.read_session(secret, request.cookies.get(security.SESSION_COOKIE))
    if session is None:
        raise LoginRequired(request.url.path)
    who = await state.run_read(security.principal_by_id, state.factory, session.key_id)
    if who is None:
        raise LoginRequired(request.url.path)
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
    parsed = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=64)
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
    return redirect(f"/ui/login?next={quote(target, safe='/')}")


async def ui_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, UiError)
    return page("error.html", None, exc.status, code=exc.status, message=exc.message)


def pages(total: int, per_page: int, page_no: int) -> dict[str, Any]:
    """Pagination of ``total`` items: current page, last page, previous/next or None."""
    last = max(0, math.ceil(total / per_page) - 1)
    return {"page": page_no, "last": last, "total": total, "per": per_page,
            "prev": page_no - 1 if page_no > 0 else None,
            "next": page_no + 1 if page_no < last else None}  # fmt: skip
