"""`POST /v1/rewrites`: m rewrites per query from the served policy (dynamically batched)."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import KeyFirstRoute, State, User
from app.api.errors import AUTHENTICATED, documented
from app.schemas import RewriteRequest, RewriteResponse
from app.services import rewrite as service

router = APIRouter(
    prefix="/v1",
    tags=["rewrites"],
    responses=documented(*AUTHENTICATED, 413),
    route_class=KeyFirstRoute,
)


@router.post("/rewrites", response_model=RewriteResponse)
async def create_rewrites(req: RewriteRequest, state: State, _: User) -> RewriteResponse:
    """Rewrite each query into `n_actions` search queries in ONE generation per query;
    with `include_results`, also each rewrite's documents and the merged list."""
    s = state.settings
    return await service.rewrite(
        req, state.batcher, state.retrieval, state.run_heavy,
        max_queries=s.api_max_queries, max_chars=s.api_max_query_chars,
        max_new_tokens=s.api_max_new_tokens, list_k=s.list_k,
    )  # fmt: skip
