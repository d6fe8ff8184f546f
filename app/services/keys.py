"""API keys: create, list, revoke, authenticate. Read :func:`authenticate` first.

Why a plain sha256 (``hashlib``, i.e. OpenSSL) and not argon2/bcrypt: a CASI key is 256 bits
from ``secrets.token_urlsafe`` (see ``app.db.repositories.generate_api_key``), not a human
password. Slow, salted password hashes exist to make guessing *low-entropy* secrets expensive;
against 2^256 possibilities guessing is hopeless at any speed, so a slow hash adds latency to
every request and nothing else. An unsalted digest also lets the key be found by one indexed
equality lookup (a salted hash would need a scan or an extra key id). This is what GitHub,
Stripe and PyPI do for their tokens. Nothing here is home-made crypto: randomness from
``secrets``, the digest from ``hashlib``. The plaintext is shown once and never stored or
logged; logs and listings show only the 8-character prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import ApiKey, ApiScope


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's id, name, scope and display prefix (never the key)."""

    key_id: int
    name: str
    scope: str
    prefix: str

    @property
    def is_admin(self) -> bool:
        return self.scope == ApiScope.ADMIN.value


@dataclass(frozen=True)
class KeyInfo:
    id: int
    name: str
    prefix: str
    scope: str
    created_at: datetime
    revoked_at: datetime | None


def create_key(factory: sessionmaker[Session], name: str, scope: str) -> tuple[KeyInfo, str]:
    """A new key → (its info, the plaintext to show once)."""
    scope = ApiScope(scope).value
    with session_scope(factory) as session:
        plaintext = repo.create_api_key(session, name, scope=scope)
        row = repo.verify_api_key(session, plaintext)
        assert row is not None
        info = _info(row)
    return info, plaintext


def list_keys(factory: sessionmaker[Session]) -> list[KeyInfo]:
    with session_scope(factory) as session:
        return [_info(k) for k in repo.list_api_keys(session)]


def revoke_key(factory: sessionmaker[Session], key_id: int) -> KeyInfo:
    """Revoke by id (idempotent); unknown id raises LookupError."""
    with session_scope(factory) as session:
        return _info(repo.revoke_api_key(session, key_id))


def authenticate(factory: sessionmaker[Session], plaintext: str) -> Principal | None:
    """The active key's principal, or None (unknown or revoked: both are 401)."""
    with session_scope(factory) as session:
        row = repo.verify_api_key(session, plaintext)
        return None if row is None else Principal(row.id, row.name, row.scope, row.prefix)


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(row.id, row.name, row.prefix, row.scope, row.created_at, row.revoked_at)
