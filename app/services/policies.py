"""Policy versions for serving: load one ready to generate, list them, activate one.

Read :func:`activate`. Loading (weights, sampler copy, content hash) is blocking torch work:
callers run it in a worker thread, then `RewriteBatcher.swap` replaces the served policy with
one reference assignment, so requests in flight finish on the old policy and none fails.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import PolicyVersion
from app.errors import CasiError, PolicyUnloadable
from app.schemas_ops import PolicyList, PolicyOut
from app.training.policy_loader import LoadedPolicy, load_policy_ref, registered

# a registered version or UnknownPolicy: defined one layer down (the job runner resolves it
# too), offered here as the service's own (`policy_service.find_registered`)
from app.training.policy_loader import find_registered as find_registered
from app.training.policy_prompt import read_prompt
from app.workers.batcher import RewriteBatcher, ServingPolicy
from evaluator.artifacts import ArtifactError
from policy.precision import build_sampler_model
from policy.sampler import default_stop_ids

log = logging.getLogger("casi.api")
LOAD_FAILURES = (OSError, ValueError, RuntimeError, ArtifactError, CasiError)
"""What loading a version's weights raises when they are missing or damaged (a folder gone, a
truncated or foreign safetensors file, a config torch or transformers refuses)."""


def serving_policy(loaded: LoadedPolicy, precision: str) -> ServingPolicy:
    """A loaded policy plus its sampler copy at ``precision`` (float32 shares the weights),
    prompted as it was trained (the prompt its folder records: `app.training.policy_prompt`)."""
    prompt = read_prompt(loaded.path)  # before the sampler copy: a bad record fails first
    sampler = build_sampler_model(loaded.model, precision, copy_weights=False)
    stops = default_stop_ids(loaded.tokenizer, loaded.model)
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    return ServingPolicy(
        loaded.model, sampler, tok, loaded.version, loaded.name, loaded.path, stops, pad,
        prompt=prompt.style, feedback_words=prompt.feedback_words,
    )  # fmt: skip


def load_serving_policy(
    ref: str | None,
    var_dir: Path,
    factory: sessionmaker[Session] | None,
    *,
    device: str,
    precision: str,
) -> ServingPolicy:
    """Load ``ref`` (registered version, HF folder, or None = default) ready to serve."""
    return serving_policy(load_policy_ref(ref, var_dir, factory, device=device), precision)


def register(factory: sessionmaker[Session], policy: ServingPolicy) -> None:
    """Make sure the served policy is a registered version (idempotent)."""
    with session_scope(factory) as session:
        if repo.get_policy_version_by_version(session, policy.version) is None:
            repo.add_policy_version(
                session,
                version=policy.version,
                name=policy.name,
                base_model=policy.path,
                path=policy.path,
                kind="base",
            )


def _out(row: PolicyVersion, active: str) -> PolicyOut:
    return PolicyOut(
        version=row.version,
        name=row.name,
        kind=row.kind,
        step=row.step,
        run_id=row.run_id,
        created_at=row.created_at,
        active=row.version == active,
        made_on=(row.meta or {}).get("made_on"),
        imported="imported_from" in (row.meta or {}),
    )


def list_policies(
    factory: sessionmaker[Session], active: str, *, limit: int, offset: int
) -> PolicyList:
    with session_scope(factory) as session:
        rows = repo.list_policy_versions(session, limit=limit, offset=offset)
        return PolicyList(active_version=active, items=[_out(r, active) for r in rows])


def get_policy(factory: sessionmaker[Session], version: str, active: str) -> PolicyOut:
    with session_scope(factory) as session:
        row = registered(session, version)
        return _out(row, active)


def activate(
    factory: sessionmaker[Session],
    batcher: RewriteBatcher,
    version: str,
    *,
    var_dir: Path,
    device: str,
    precision: str,
) -> PolicyOut:
    """Load a registered version and serve it from the next batch on (blocking: a thread).
    An unknown version is an UnknownPolicy (404); one whose weights cannot be loaded a
    PolicyUnloadable (409 naming ``path.version``; the reason is logged, and the message names
    no path on this machine), the served policy left as it was."""
    with session_scope(factory) as session:
        full_version = registered(session, version).version
    if batcher.policy.version != full_version:
        try:
            loaded = load_serving_policy(
                full_version, var_dir, factory, device=device, precision=precision
            )
        except LOAD_FAILURES as exc:
            log.warning("policy version %s could not be loaded: %s", full_version, exc)
            raise PolicyUnloadable(
                f"policy version {full_version} cannot be loaded: its weights are missing or "
                f"damaged ({type(exc).__name__}; the server log says more); still serving "
                f"{batcher.policy.version}"
            ) from None
        batcher.swap(loaded)
    return get_policy(factory, full_version, batcher.policy.version)
