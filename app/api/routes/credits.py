"""`POST /v1/credits` (the one credit path, persisted) and `GET /v1/credits/{record_id}`."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import State, User
from app.api.errors import ApiError
from app.schemas import CreditRequest, CreditResponse, ErrorResponse
from app.services import credits as service

router = APIRouter(prefix="/v1", tags=["credits"], responses={422: {"model": ErrorResponse}})


@router.post("/credits", response_model=CreditResponse, status_code=201)
async def create_credit(req: CreditRequest, state: State, _: User) -> CreditResponse:
    """Value table of every coalition, exact Shapley φ, baselines, shaped advantages."""
    out = await state.run_blocking(
        service.compute_and_store, req, state.retrieval, state.scorers, state.factory,
        list_k=state.settings.list_k,
    )  # fmt: skip
    state.metrics.credits.inc()
    return out


@router.get("/credits/{record_id}", response_model=CreditResponse)
def read_credit(record_id: int, state: State, _: User) -> CreditResponse:
    """A stored credit record."""
    out = service.get_credit(state.factory, record_id)
    if out is None:
        raise ApiError(404, f"no credit record {record_id}", field="path.record_id")
    return out
