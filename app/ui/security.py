"""Sessions, CSRF and response headers of the dashboard. Read :func:`issue_session` and
:func:`current_principal`.

The browser never holds the API key. Logging in checks the key once (``app.services.keys``,
the same keys and scopes as the REST API) and sets an HttpOnly, SameSite=Strict cookie with a
**signed, expiring token**: ``base64(json{key id, expiry, nonce}) . HMAC-SHA256``. The signing
secret is 32 random bytes in ``<var>/ui/session.key`` (mode 0600, created once), so every
worker of ``casi serve --workers N`` and a restart accept the same sessions. Each request
re-reads the key by id: a revoked key ends its sessions at once. Logout clears the cookie; so
does any request whose session has ended (key revoked, token expired or not ours), which then
lands on the login form saying why (:data:`SESSION_ENDED`), never in a redirect loop.

CSRF: every state-changing form carries ``csrf`` = HMAC(secret, "csrf:" + the session's
nonce), checked in constant time; the login form is tied the same way to a random pre-login
cookie. SameSite=Strict already keeps other sites' posts from carrying the cookie; the token is
the second lock.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import session_scope
from app.db.models import ApiKey
from app.services.keys import Principal

SESSION_COOKIE = "casi_ui"
LOGIN_COOKIE = "casi_ui_login"
SESSION_TTL_S = 8 * 3600
# The cookie outlives its token by a day, so a request after the expiry still carries it and
# the login page can say the session expired (the token's own expiry is what is enforced).
COOKIE_TTL_S = SESSION_TTL_S + 24 * 3600
# Why a session ended, as the login page says it (the keys of `session_state` and of a key
# that is no longer active).
SESSION_ENDED = {
    "revoked": "Your API key was revoked: log in with an active key.",
    "expired": "Your session expired: log in again.",
    "invalid": "Your session is no longer valid: log in again.",
}
COOKIE_PATH = "/ui"
# No external origin anywhere: scripts and styles from this server only, no inline script or
# style, forms post here only, the page is never framed by another site.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-src 'self'; form-action 'self'; base-uri 'none'; "
    "frame-ancestors 'none'"
)
# The embedded audit report (the project's own self-contained HTML: inline <style>, no script).
REPORT_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'self'"
)
_secrets: dict[Path, bytes] = {}
_lock = threading.Lock()


def secret_for(var_dir: Path) -> bytes:
    """The signing secret under ``var_dir`` (created atomically on first use)."""
    path = (Path(var_dir) / "ui" / "session.key").resolve()
    with _lock:
        if path in _secrets:
            return _secrets[path]
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            value = bytes.fromhex(path.read_text().strip())
        else:
            value = secrets.token_bytes(32)
            with os.fdopen(fd, "w") as fh:
                fh.write(value.hex())
        if len(value) < 32:
            raise RuntimeError(f"{path}: damaged session secret (delete it to make a new one)")
        _secrets[path] = value
        return value


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: bytes, message: str) -> str:
    return _b64(hmac.new(secret, message.encode(), hashlib.sha256).digest())


@dataclass(frozen=True)
class UiSession:
    key_id: int
    expires: float
    nonce: str


def issue_session(secret: bytes, key_id: int, now: float | None = None) -> str:
    """A signed token for ``key_id``, valid for SESSION_TTL_S."""
    body = {"k": key_id, "e": int((now or time.time()) + SESSION_TTL_S), "n": secrets.token_hex(16)}
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    return f"{payload}.{_sign(secret, payload)}"


def session_state(
    secret: bytes, token: str | None, now: float | None = None
) -> tuple[UiSession | None, str | None]:
    """(the session, None) for a valid, unexpired token; (None, why) otherwise: why is None
    when there is no token, "expired" past its expiry, "invalid" when it is not ours."""
    if not token:
        return None, None
    if token.count(".") != 1 or len(token) > 512:
        return None, "invalid"
    payload, signature = token.split(".")
    # bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500)
    if not hmac.compare_digest(signature.encode(), _sign(secret, payload).encode()):
        return None, "invalid"
    try:
        body: Any = json.loads(_unb64(payload))
        session = UiSession(int(body["k"]), float(body["e"]), str(body["n"]))
    except (ValueError, KeyError, TypeError):
        return None, "invalid"
    if session.expires <= (now or time.time()):
        return None, "expired"
    return session, None


def read_session(secret: bytes, token: str | None, now: float | None = None) -> UiSession | None:
    """The session in a valid, unexpired token, else None."""
    return session_state(secret, token, now)[0]


def csrf_token(secret: bytes, nonce: str, purpose: str = "csrf") -> str:
    return _sign(secret, f"{purpose}:{nonce}")


def check_csrf(secret: bytes, nonce: str | None, sent: str | None, purpose: str = "csrf") -> bool:
    if not nonce or not sent:
        return False
    return hmac.compare_digest(sent.encode(), csrf_token(secret, nonce, purpose).encode())


def principal_by_id(factory: sessionmaker[Session], key_id: int) -> Principal | None:
    """The active key ``key_id`` as a principal (None when unknown or revoked)."""
    with session_scope(factory) as session:
        row = session.get(ApiKey, key_id)
        if row is None or row.revoked_at is not None:
            return None
        return Principal(row.id, row.name, row.scope, row.prefix)


def security_headers(csp: str = CSP) -> dict[str, str]:
    return {
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "SAMEORIGIN" if csp is REPORT_CSP else "DENY",
        "Cache-Control": "no-store",
    }
