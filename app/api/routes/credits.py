"""`POST /v1/credits` (the one credit path, persisted) and `GET /v1/credits/{record_id}`."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import KeyFirstRoute, RecordId, State, User
from app.api.errors import AUTHENTICATED, ApiError, documented
from app.schemas import CreditRequest, CreditResponse
from app.services import credits as service

router = APIRouter(
    prefix="/v1", tags=["credits"], responses=documented(*AUTHENTICATED), route_class=KeyFirstRoute
)


@router.post("/credits", response_model=CreditResponse, status_code=201,
             responses=documented(404, 409, 413, s409="The query clashes with the dataset: a text "
                                  "several scorable queries share, or query and query_id that "
                                  "disagree (the field names which)."))  # fmt: skip
async def create_credit(req: CreditRequest, state: State, _: User) -> CreditResponse:
    """Value table of every coalition, exact Shapley φ, baselines, shaped advantages.

    404 when the dataset has no such query: an unknown `query_id`, or (replay) a `query` text
    that no judged query has."""
    out = await state.run_heavy(
        service.compute_and_store, req, state.retrieval, state.scorers, state.factory,
        list_k=state.settings.list_k,
    )  # fmt: skip
    state.metrics.credits.inc()
    return out


@router.get("/credits/{record_id}", response_model=CreditResponse, responses=documented(404))
async def read_credit(record_id: RecordId, state: State, _: User) -> CreditResponse:
    """A stored credit record."""
    out = await state.run_read(service.get_credit, state.factory, record_id)
    if out is None:
        raise ApiError(404, f"no credit record {record_id}", field="path.record_id")
    return out
