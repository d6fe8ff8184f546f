"""Per-key token buckets: ``rate`` requests per second sustained, bursts of ``burst``.

In memory, per API process (with ``--workers N`` each worker limits separately, so a key's
ceiling is N × rate). :meth:`RateLimiter.take` returns 0 when the request may proceed, else
the seconds until it may (the 429's Retry-After).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate, self.burst = rate_per_s, burst
        self._buckets: dict[Hashable, tuple[float, float]] = {}  # key → (tokens, last time)
        self._lock = threading.Lock()

    def take(self, key_id: Hashable, now: float | None = None) -> float:
        if self.rate <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.get(key_id, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[key_id] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key_id] = (tokens, now)
            return (1.0 - tokens) / self.rate


class FailureLimiter:
    """Failed authentications per client address: ``per_min`` a minute, bursts of as many.

    :meth:`blocked` is the seconds until an address may try again (0 = it may); each failure
    is recorded with :meth:`fail`. Only wrong keys count (a missing key never reaches the
    database). ``per_min`` 0 = no limit.
    """

    def __init__(self, per_min: float) -> None:
        self._bucket = RateLimiter(per_min / 60.0, max(1, int(per_min)))
        self.enabled = per_min > 0

    def blocked(self, address: str, now: float | None = None) -> float:
        if not self.enabled:
            return 0.0
        now = time.monotonic() if now is None else now
        b = self._bucket
        with b._lock:
            tokens, last = b._buckets.get(address, (float(b.burst), now))
            tokens = min(float(b.burst), tokens + (now - last) * b.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / b.rate

    def fail(self, address: str, now: float | None = None) -> None:
        if self.enabled:
            self._bucket.take(address, now)
