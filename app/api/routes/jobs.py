"""Training jobs: start `casi train` (admin), list, read, cancel (admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.api.deps import Admin, Limit, Offset, State, User
from app.db.models import JobStatus
from app.schemas import ErrorResponse, TrainJobList, TrainJobOut, TrainJobRequest

router = APIRouter(
    prefix="/v1/train-jobs", tags=["train-jobs"],
    responses={404: {"model": ErrorResponse}, 409: {"model": ErrorResponse}},
)  # fmt: skip


@router.post("", response_model=TrainJobOut, status_code=201)
def start_job(req: TrainJobRequest, state: State, _: Admin) -> TrainJobOut:
    """Start `casi train --preset ... --name job-<id>` in its own process group."""
    return state.jobs.start(req)


@router.get("", response_model=TrainJobList)
def list_jobs(
    state: State, _: User, limit: Limit = 50, offset: Offset = 0,
    status: Annotated[JobStatus | None, Query(description="Only jobs in this state.")] = None,
) -> TrainJobList:  # fmt: skip
    """Jobs, newest first (a dead worker shows as failed, never as running)."""
    return state.jobs.list_jobs(limit=limit, offset=offset, status=status.value if status else None)


@router.get("/{job_id}", response_model=TrainJobOut)
def read_job(job_id: int, state: State, _: User) -> TrainJobOut:
    """Status, latest step and metrics, held-out evaluations."""
    return state.jobs.get(job_id)


@router.post("/{job_id}/cancel", response_model=TrainJobOut)
def cancel_job(job_id: int, state: State, _: Admin) -> TrainJobOut:
    """Stop the job's process group (SIGTERM, then SIGKILL) → cancelled."""
    return state.jobs.cancel(job_id)
