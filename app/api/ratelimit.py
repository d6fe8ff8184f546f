"""Per-key token buckets: ``rate`` requests per second sustained, bursts of ``burst``.

In memory, per API process (with ``--workers N`` each worker limits separately, so a key's
ceiling is N × rate). :meth:`RateLimiter.take` returns 0 when the request may proceed, else
the seconds until it may (the 429's Retry-After).
"""

from __future__ import annotations

import threading
import time


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate, self.burst = rate_per_s, burst
        self._buckets: dict[int, tuple[float, float]] = {}  # key id → (tokens, last time)
        self._lock = threading.Lock()

    def take(self, key_id: int, now: float | None = None) -> float:
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
