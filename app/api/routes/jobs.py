"""Training jobs: start `casi train` (admin), list, read, cancel (admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.api.deps import Admin, KeyFirstRoute, Limit, Offset, RecordId, State, User
from app.api.errors import AUTHENTICATED, documented
from app.db.models import JobStatus
from app.schemas_ops import TrainJobList, TrainJobOut, TrainJobRequest

router = APIRouter(
    prefix="/v1/train-jobs",
    tags=["train-jobs"],
    responses=documented(*AUTHENTICATED),
    route_class=KeyFirstRoute,
)


@router.post(
    "", response_model=TrainJobOut, status_code=201, responses=documented(403, 404, 409, 413)
)
def start_job(req: TrainJobRequest, state: State, _: Admin) -> TrainJobOut:
    """Start `casi train --preset ... --name job-<id>` in its own process group; 422 naming
    `body.evaluator` for an evaluator this server has not built (a surrogate not fitted); 404
    naming `body.policy` when no registered version matches `policy`; 409 when
    CASI_API_MAX_RUNNING_JOBS jobs are already queued or running."""
    return state.jobs.start(
        req, max_running=state.settings.api_max_running_jobs, evaluators=state.scorers
    )


@router.get("", response_model=TrainJobList)
async def list_jobs(
    state: State, _: User, limit: Limit = 50, offset: Offset = 0,
    status: Annotated[JobStatus | None, Query(description="Only jobs in this state.")] = None,
) -> TrainJobList:  # fmt: skip
    """Jobs, newest first (a dead worker shows as failed, never as running)."""
    return await state.run_read(
        lambda: state.jobs.list_jobs(
            limit=limit, offset=offset, status=status.value if status else None
        )
    )


@router.get("/{job_id}", response_model=TrainJobOut, responses=documented(404))
async def read_job(job_id: RecordId, state: State, _: User) -> TrainJobOut:
    """Status, latest step and metrics, held-out evaluations."""
    return await state.run_read(state.jobs.get, job_id)


@router.post("/{job_id}/cancel", response_model=TrainJobOut, responses=documented(403, 404, 409))
def cancel_job(job_id: RecordId, state: State, _: Admin) -> TrainJobOut:
    """Mark the job (and its run) cancelled, then stop its process group (SIGTERM, then
    SIGKILL). Idempotent: cancelling a cancelled job answers it again; 409 once it finished
    or failed."""
    return state.jobs.cancel(job_id)
