"""`/healthz` (the process answers), `/readyz` (each component), `/metrics` (Prometheus)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from app.api.deps import State, built_state
from app.api.errors import documented
from app.api.metrics import CONTENT_TYPE
from app.api.startup import RETRY_AFTER_S, startup_of
from app.schemas_ops import Health, Readiness
from app.services.health import readiness

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up (no dependency is checked; 200 while start-up work still runs)."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(request: Request) -> JSONResponse:
    """Database, Redis, index and policy, each reported. 200 `ready`, or 200 `degraded` when
    only Redis (the cache) is down; 503 `not_ready` naming what is down otherwise. While the
    server is still starting: 503 naming `startup`, with `reason` saying what start-up is
    doing and how far along it is."""
    state = built_state(request)
    if state is None:
        ready = startup_of(request.app.state).readiness()
        return JSONResponse(
            ready.model_dump(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    ready = await anyio.to_thread.run_sync(readiness, state.engine, state.retrieval, state.batcher)
    return JSONResponse(ready.model_dump(), status_code=503 if ready.status == "not_ready" else 200)


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE: {"example": "casi_credits_computed_total 3.0"}}},
        **documented(503),
    },
)
async def metrics(state: State) -> Response:
    """Prometheus text format."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
