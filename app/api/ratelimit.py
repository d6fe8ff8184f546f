"""Per-key token buckets: ``rate`` requests per second sustained, bursts of ``burst``.

In memory, per API process (with ``--workers N`` each worker limits separately, so a key's
ceiling is N × rate). :meth:`RateLimiter.take` returns 0 when the request may proceed, else
the seconds until it may (the 429's Retry-After).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
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

    A key check takes its token BEFORE the key is looked up (:meth:`attempt`, under the lock),
    and :meth:`settle` gives it back once the key proved valid. So a check in flight counts as
    a failure until it is known not to be one: N concurrent wrong keys take N tokens before
    any look-up finishes, and the ones past the limit are refused (checking first and
    recording after let every concurrent guess through). A key that proved valid lately (the
    last :data:`KNOWN_KEYS`, kept as sha256 digests) takes no token, so a client's concurrent
    requests with its own key never run into the limit; it is still refused while its address
    is blocked, and counted as a failure if it stops being valid (revoked). A missing key never
    reaches the database and is not counted. ``per_min`` 0 = no limit.
    """

    KNOWN_KEYS = 4096

    def __init__(self, per_min: float) -> None:
        self._bucket = RateLimiter(per_min / 60.0, max(1, int(per_min)))
        self.enabled = per_min > 0
        self._known: OrderedDict[bytes, None] = OrderedDict()

    def blocked(self, address: str, now: float | None = None) -> float:
        """The seconds until ``address`` may try again (0 = now), taking nothing."""
        if not self.enabled:
            return 0.0
        now = time.monotonic() if now is None else now
        b = self._bucket
        with b._lock:
            tokens, last = b._buckets.get(address, (float(b.burst), now))
            tokens = min(float(b.burst), tokens + (now - last) * b.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / b.rate

    def attempt(self, address: str, key: str, now: float | None = None) -> tuple[float, bool]:
        """(the seconds until ``address`` may try (0 = go on now), whether this check took an
        attempt): a key not known valid takes one, counted as a failure until :meth:`settle`."""
        if not self.enabled:
            return 0.0, False
        with self._bucket._lock:
            known = _digest(key) in self._known
        if known:
            return self.blocked(address, now), False
        wait = self._bucket.take(address, now)
        return wait, wait == 0

    def settle(self, address: str, key: str, *, taken: bool, valid: bool | None) -> None:
        """The look-up's outcome: ``valid`` True gives the attempt back and remembers the key;
        False keeps it (a key known valid that took none takes one now, and is forgotten);
        None (the look-up itself failed: the database) gives it back."""
        if not self.enabled:
            return
        b, digest = self._bucket, _digest(key)
        with b._lock:
            if valid:
                self._known[digest] = None
                self._known.move_to_end(digest)
                while len(self._known) > self.KNOWN_KEYS:
                    self._known.popitem(last=False)
            elif valid is False:
                self._known.pop(digest, None)
            if taken and valid is not False and address in b._buckets:
                tokens, last = b._buckets[address]
                b._buckets[address] = (min(float(b.burst), tokens + 1.0), last)
        if valid is False and not taken:
            self.fail(address)

    def fail(self, address: str, now: float | None = None) -> None:
        """Record a failure that took no attempt first."""
        if self.enabled:
            self._bucket.take(address, now)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
