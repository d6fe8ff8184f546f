"""A training run's record and lifecycle (`casi train`, the experiments' cells, the API's jobs):
its handle (database id, folder), opening it, reading and resuming it under its lock
(:func:`run_lock`: one process per run), what a resume must find again (the start, the index,
the KL reference), and how it ends when interrupted or failed (:func:`end_run`). The training
loop that writes it is `app.training.train`.

A resume reads the run first (:func:`load_run`), its caller checks what it must find again,
and only then :func:`resume_run` drops the rows written after the last resume state (the
resumed run recomputes them exactly) and sets the run running: a refused resume changes
nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import PolicyVersion, RunStatus
from app.runtime import Retrieval
from app.training.policy_loader import LoadedPolicy
from evaluator.locks import holder_text, lock_if_free
from policy.checkpoint import state_step
from policy.train_config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class RunHandle:
    """Where a run lives: its database id and its folder under var/runs/."""

    run_id: int
    folder: Path
    start_step: int = 0
    policy_version_id: int | None = None
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)
    skip_start_eval: bool = False  # the experiment evaluates the shared starting policy once
    last_checkpoint: tuple[str, Path] | None = None  # (version, folder) of the newest checkpoint

    @property
    def state_dir(self) -> Path:
        return self.folder / "state"

    @property
    def metrics_path(self) -> Path:
        return self.folder / "metrics.jsonl"


def open_run(
    factory: sessionmaker[Session],
    var_dir: Path,
    cfg: TrainConfig,
    policy: LoadedPolicy,
    name: str | None,
    meta: dict[str, Any],
) -> RunHandle:
    """Register a new run (and its starting policy version) in the database. ``meta`` holds what
    `--resume` needs beside the config: the policy reference, the evaluator, the index slice."""
    with session_scope(factory) as session:
        pv = repo.get_or_add_policy_version(
            session, version=policy.version, name=policy.name, base_model=policy.base_model,
            path=policy.path, kind=policy.kind,
        )  # fmt: skip
        run = repo.create_run(
            session, name=name or f"train-{cfg.preset}", preset=cfg.preset,
            config={"train": cfg.to_dict(), **jsonable(meta)}, policy_version_id=pv.id,
        )  # fmt: skip
        run_id, pv_id = run.id, pv.id
    folder = var_dir / "runs" / str(run_id)
    folder.mkdir(parents=True, exist_ok=True)
    return RunHandle(run_id, folder, 0, pv_id)


def load_run(
    factory: sessionmaker[Session], var_dir: Path, run_id: int
) -> tuple[RunHandle, TrainConfig, dict[str, Any]]:
    """The stored config and meta of ``run_id`` and the step of its last saved state, read
    only: a resume checks them (its index, its references) before :func:`resume_run` changes
    anything."""
    with session_scope(factory) as session:
        run = repo.get_run(session, run_id)
        if run is None:
            raise LookupError(f"no training run with id {run_id} (see `casi report runs`)")
        stored = dict(run.config)
        if "train" not in stored:
            raise ValueError(
                f"run {run_id} was not made by `casi train` (a `casi step` run?): it cannot be resumed"
            )
        cfg = TrainConfig.from_dict(stored.pop("train"))
        handle = RunHandle(run_id, var_dir / "runs" / str(run_id), 0, run.policy_version_id)
    handle.start_step = state_step(handle.state_dir) or 0
    return handle, cfg, stored


def resume_run(
    factory: sessionmaker[Session], var_dir: Path, run_id: int
) -> tuple[RunHandle, TrainConfig, dict[str, Any]]:
    """The stored config and meta of ``run_id`` and the step of its last saved state (rows after
    it are dropped: the resumed run recomputes them exactly), the run set running again. Done
    under the run's lock (:func:`run_lock`): refused while another process trains it. The
    metrics JSONL is read before anything is dropped: a torn last line (a crash mid-write) is
    dropped, any other unreadable line refuses the resume with the database untouched."""
    handle, cfg, stored = load_run(factory, var_dir, run_id)
    keep = handle.start_step if handle.start_step > 0 else -1  # from scratch: the step-0 eval too
    with run_lock(handle):
        lines = _kept_jsonl(handle.metrics_path, keep)
        with session_scope(factory) as session:
            run = repo.get_run(session, run_id)
            if run is None:  # deleted since load_run read it
                raise LookupError(f"no training run with id {run_id} (see `casi report runs`)")
            repo.truncate_run_after(session, run_id, keep)
            run.status = RunStatus.RUNNING.value
            run.finished_at = None
        if lines is not None:
            _write_jsonl(handle.metrics_path, lines)
    return handle, cfg, stored


@contextmanager
def run_lock(handle: RunHandle) -> Iterator[None]:
    """Hold run ``handle``'s inter-process lock (``.run.lock`` in its folder, recording this
    process's id) or refuse at once, naming the holder: two processes training or resuming one
    run would drop each other's records and write one state. Re-entrant within a process."""
    target = handle.folder / "run"
    with lock_if_free(target, record_holder=True) as free:
        if not free:
            raise ValueError(
                f"run {handle.run_id} is being trained by another casi process "
                f"({holder_text(target)}): let it finish, or stop it and resume it then"
            )
        yield


def pin_start(meta: dict[str, Any], policy: LoadedPolicy) -> None:
    """Store the start a reference resolved to (its weight hash), not the reference: a resume
    loads that version, whatever ``warmstart`` (the newest warm start) names by then."""
    if meta.get("policy") != policy.version:
        meta["policy_ref"] = meta.get("policy")
    meta["policy"] = policy.version


def check_start(
    factory: sessionmaker[Session], handle: RunHandle, policy: LoadedPolicy, ref: str | None
) -> None:
    """Refuse to resume run ``handle`` from weights other than the ones it started from."""
    with session_scope(factory) as session:
        row = session.get(PolicyVersion, handle.policy_version_id)
        started = row.version if row is not None else None
    if started is not None and started != policy.version:
        raise ValueError(
            f"run {handle.run_id} started from policy {started}, but its policy reference "
            f"{ref!r} now resolves to {policy.version}: refusing to resume from another start "
            "(start a new run instead)"
        )


def pin_index_and_reference(
    meta: dict[str, Any], retrieval: Retrieval, reference: LoadedPolicy | None
) -> None:
    """Store what a resume must find again beside the settings: the index the run started on
    (its version and size) and the version its KL reference resolved to (None: the start)."""
    meta["index_version"] = retrieval.index.version
    meta["index_docs"] = len(retrieval.index)
    meta["reference_version"] = None if reference is None else reference.version


def check_index_and_reference(
    handle: RunHandle,
    meta: dict[str, Any],
    retrieval: Retrieval,
    reference: LoadedPolicy | None,
    reference_ref: str | None,
) -> None:
    """Refuse to resume run ``handle`` on another index, or with a KL reference that now
    resolves to other weights, than the ones it started with (a run stored before these were
    pinned is not checked)."""
    started = meta.get("index_version")
    if started is not None and started != retrieval.index.version:
        docs = meta.get("index_docs")
        raise ValueError(
            f"run {handle.run_id} started on index {started}"
            + (f" ({docs} docs)" if docs is not None else "")
            + f", but its stored settings now build index {retrieval.index.version} "
            f"({len(retrieval.index)} docs) from {retrieval.dataset.path}: refusing to resume on "
            "another index (restore the corpus it trained on, or start a new run)"
        )
    if "reference_version" not in meta or reference is None:
        return
    pinned = meta["reference_version"]
    if pinned != reference.version:
        raise ValueError(
            f"run {handle.run_id}'s KL reference {reference_ref!r} resolved to {pinned} when it "
            f"started, but now resolves to {reference.version}: refusing to resume against "
            "another reference (start a new run instead)"
        )


def end_run(factory: sessionmaker[Session], run_id: int, exc: BaseException) -> None:
    """Mark run ``run_id``, still `running`, ended by ``exc``: `cancelled` for an interrupt
    (Ctrl-C, a SIGTERM, an exit: what is no ``Exception``), `failed` for anything else; a
    resume sets it running again. A run another writer already ended (a cancelled API job)
    keeps its status; a database that cannot be written is logged, never hides ``exc``."""
    status = RunStatus.FAILED if isinstance(exc, Exception) else RunStatus.CANCELLED
    try:
        with session_scope(factory) as session:
            run = repo.get_run(session, run_id)
            if run is not None and run.status == RunStatus.RUNNING.value:
                repo.finish_run(session, run_id, status=status)
    except Exception:  # noqa: BLE001 - the training's own failure is what the caller sees
        log.warning("could not mark run %s %s", run_id, status.value, exc_info=True)


def _kept_jsonl(path: Path, step: int) -> list[str] | None:
    """The JSONL lines of steps ≤ ``step`` (a resumed run rewrites the rest); None without a
    file. A last line that does not parse is a write the crash tore, dropped; any other is a
    ValueError naming the file and the line."""
    if not path.is_file():
        return None
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    kept = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row_step = row["step"]
            if not isinstance(row_step, int) or isinstance(row_step, bool):
                raise TypeError(f"step {row_step!r} is not an integer")
        except (ValueError, TypeError, KeyError) as exc:
            if i == last:
                continue  # torn by the crash: the resume recomputes that step
            why = (
                "no 'step' field"
                if isinstance(exc, KeyError)
                else f"invalid JSON, {exc.msg}"
                if isinstance(exc, json.JSONDecodeError)
                else str(exc)
            )
            raise ValueError(
                f"{path} line {i + 1} is not a metrics record ({why}): repair or remove that "
                "line, then resume again"
            ) from None
        if row_step <= step:
            kept.append(line)
    return kept


def _write_jsonl(path: Path, lines: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    tmp.replace(path)


def jsonable(obj: Any) -> Any:
    """Plain JSON types (paths as strings)."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj
