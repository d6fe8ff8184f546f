"""Readiness: is each component the API needs usable right now? Read :func:`readiness`.

What readiness means: the API can answer its requests correctly. The database, the index and
the policy are required (any of them down → ``not_ready``, 503: take the instance out of
rotation). Redis is only the action cache: without it retrieval runs uncached and responses say
``cache: degraded``, so Redis alone down → ``degraded``, still 200 (keep serving; alert on it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy import text

from app.db.session import is_at_head
from app.schemas import Component, Readiness

OPTIONAL = frozenset({"redis"})  # down → degraded, still ready

if TYPE_CHECKING:
    from app.lifespan import AppState


def _check(probe: Callable[[], str]) -> Component:
    try:
        return Component(ok=True, detail=probe())
    except Exception as exc:  # any failure means "not usable": report it, never raise
        return Component(
            ok=False,
            detail=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300],
        )


def readiness(state: AppState) -> Readiness:
    def database() -> str:
        with state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        if not is_at_head(state.engine):
            raise RuntimeError("schema not at the newest migration: run `casi db upgrade`")
        return f"{state.engine.dialect.name} at head"

    def redis() -> str:
        state.retrieval.redis_client.ping()
        return "ping ok"

    def index() -> str:
        n = len(state.retrieval.index)
        if n == 0:
            raise RuntimeError("the index is empty")
        return f"{n} documents, version {state.retrieval.index.version}"

    def policy() -> str:
        if not state.batcher.alive:
            raise RuntimeError("the rewrite batcher thread is not running")
        p = state.batcher.policy
        return f"{p.version} ({p.name})"

    components = {name: _check(fn) for name, fn in
                  (("database", database), ("redis", redis), ("index", index), ("policy", policy))}  # fmt: skip
    down = [name for name, c in components.items() if not c.ok]
    status = "ready" if not down else "degraded" if set(down) <= OPTIONAL else "not_ready"
    return Readiness(status=status, components=components, down=down)
