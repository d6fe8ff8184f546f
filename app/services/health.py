"""Readiness: is each component the API needs usable right now? Read :func:`readiness`.

What readiness means: the API can answer its requests correctly. The database, the index and
the policy are required (any of them down → ``not_ready``, 503: take the instance out of
rotation). Redis is only the action cache: without it retrieval runs uncached and responses say
``cache: degraded``, so Redis alone down → ``degraded``, still 200 (keep serving; alert on it).
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Engine, text

from app.db.records import game_of
from app.db.session import is_at_head
from app.runtime import Retrieval
from app.schemas_ops import Component, Readiness
from app.workers.batcher import RewriteBatcher

OPTIONAL = frozenset({"redis"})  # down → degraded, still ready


def _check(probe: Callable[[], str]) -> Component:
    try:
        return Component(ok=True, detail=probe())
    except Exception as exc:  # any failure means "not usable": report it, never raise
        return Component(
            ok=False,
            detail=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300],
        )


def readiness(engine: Engine, retrieval: Retrieval, batcher: RewriteBatcher) -> Readiness:
    def database() -> str:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        if not is_at_head(engine):
            raise RuntimeError("schema not at the newest migration: run `casi db upgrade`")
        return f"{engine.dialect.name} at head"

    def redis() -> str:
        retrieval.redis_client.ping()
        return "ping ok"

    def index() -> str:
        n = len(retrieval.index)
        if n == 0:
            raise RuntimeError("the index is empty")
        ex = retrieval.executor
        return (
            f"{n} documents, version {retrieval.index.version}; {ex.retriever.name} retrieval, "
            f"game {game_of(ex.merge)} (merge {ex.merge}, k {ex.k})"
        )

    def policy() -> str:
        if not batcher.alive:
            raise RuntimeError("the rewrite batcher thread is not running")
        p = batcher.policy
        return f"{p.version} ({p.name})"

    components = {name: _check(fn) for name, fn in
                  (("database", database), ("redis", redis), ("index", index), ("policy", policy))}  # fmt: skip
    down = [name for name, c in components.items() if not c.ok]
    status = "ready" if not down else "degraded" if set(down) <= OPTIONAL else "not_ready"
    reason = "; ".join(f"{name}: {components[name].detail}" for name in down) or None
    return Readiness(status=status, components=components, down=down, reason=reason)
