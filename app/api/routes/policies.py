"""Policy versions: list, read, and activate one for serving (admin)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter

from app.api.deps import Admin, KeyFirstRoute, Limit, Offset, State, User, VersionRef
from app.api.errors import AUTHENTICATED, documented
from app.schemas_ops import PolicyList, PolicyOut
from app.services import policies as service

router = APIRouter(
    prefix="/v1/policies",
    tags=["policies"],
    responses=documented(*AUTHENTICATED),
    route_class=KeyFirstRoute,
)


@router.get("", response_model=PolicyList)
async def list_policies(state: State, _: User, limit: Limit = 50, offset: Offset = 0) -> PolicyList:
    """Registered policy versions, newest first, and the one being served."""
    return await state.run_read(
        lambda: service.list_policies(
            state.factory, state.batcher.policy.version, limit=limit, offset=offset
        )
    )


@router.get("/{version}", response_model=PolicyOut, responses=documented(404))
async def read_policy(version: VersionRef, state: State, _: User) -> PolicyOut:
    """One version (the full hash or a unique prefix of ≥ 6 characters)."""
    return await state.run_read(
        service.get_policy, state.factory, version, state.batcher.policy.version
    )


UNLOADABLE = (
    "The version's weights cannot be loaded (missing or damaged; field: path.version): the "
    "served policy is unchanged."
)


@router.post(
    "/{version}/activate", response_model=PolicyOut,
    responses=documented(403, 404, 409, s409=UNLOADABLE),
)  # fmt: skip
async def activate_policy(version: VersionRef, state: State, _: Admin) -> PolicyOut:
    """Serve this version from now on. It is loaded off the event loop while the old one keeps
    serving, then swapped in atomically: no request fails. 404 when no registered version
    matches; 409 naming `path.version` when its weights are missing or damaged (the served
    policy is unchanged)."""
    s = state.settings
    async with state.activation:  # one load at a time
        return await anyio.to_thread.run_sync(
            lambda: service.activate(state.factory, state.batcher, version, var_dir=s.var_dir,
                                     device=s.resolved_device(), precision=s.api_precision)
        )  # fmt: skip
