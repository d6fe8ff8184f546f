"""What every request of one API process shares: :class:`AppState`, built once by the
composition root (`app.lifespan.build_state`) and reached by the routes through
`app.api.deps.State` (and by the dashboard through `app.ui.render`).

Threads: credit and retrieval work runs in ONE heavy thread (`run_heavy`; the embedder, FAISS
index and executor are shared), cheap reads run under their own small capacity limiter
(`run_read`), and key look-ups under another, so a flood of reads cannot take the threads a
credit needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.api.metrics import Metrics
from app.api.ratelimit import FailureLimiter, RateLimiter
from app.runtime import Retrieval
from app.settings import Settings
from app.workers.batcher import RewriteBatcher
from app.workers.jobs import JobRunner
from evaluator.scorers import SetScorer

T = TypeVar("T")
# Few threads on purpose: every thread that wants the GIL delays the heavy thread each time it
# gives the GIL up (Redis, SQLite, torch ops). Measured with load_api.py, 16 clients on credits
# and 16 on reads: 4 read + 8 auth threads gave credits 20.6 req/s beside 209 reads/s;
# 1 + 2 give credits 80.3 req/s beside 200 reads/s (credits alone: ~150 req/s either way).
READ_THREADS = 1  # cheap database reads in flight at once (the rest wait on the event loop)
AUTH_THREADS = 2  # key look-ups in flight at once


@dataclass
class AppState:
    """The built components, shared by every request of one API process."""

    settings: Settings
    engine: Engine
    factory: sessionmaker[Session]
    retrieval: Retrieval
    scorers: dict[str, SetScorer]
    batcher: RewriteBatcher
    jobs: JobRunner
    metrics: Metrics
    limiter: RateLimiter
    auth_failures: FailureLimiter = field(default_factory=lambda: FailureLimiter(0))
    policy_registered: bool = False
    compute: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="casi-heavy")
    )
    activation: asyncio.Lock = field(default_factory=asyncio.Lock)
    reads: anyio.CapacityLimiter = field(
        default_factory=lambda: anyio.CapacityLimiter(READ_THREADS)
    )
    auth: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(AUTH_THREADS))

    async def run_heavy(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run retrieval / credit work in THE heavy thread (one at a time: the executor,
        embedder and FAISS index are shared), awaiting it without blocking the event loop."""
        return await asyncio.wrap_future(self.compute.submit(fn, *args, **kwargs))

    run_blocking = run_heavy  # the former name

    async def run_read(self, fn: Callable[..., T], *args: Any) -> T:
        """A cheap blocking read (database listing) under the read limiter."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.reads)
