"""The `casi train` service: a training run end to end, recorded, checkpointed and resumable.

Read :func:`run_training` first. Per step: the step's TRAIN queries (`query_order`, a pure
function of seed and step) → `Trainer.train_step` → the step's metrics to the database and to
`var/runs/<id>/metrics.jsonl` → the resume state every `state_every` steps → a registered
checkpoint every `checkpoint_every` steps (and whenever a held-out evaluation runs, so every
evaluation belongs to a stored policy version) → held-out evaluation every `eval_every` steps.
The same records go to the run's trackers (`--report-to`, `app.training.trackers`), fed by the
writer right after the database and the JSONL; a tracker that fails never stops the run.

Order of writes in a step: records first, then the resume state. A run killed between the two
resumes from the previous state and recomputes the step; `truncate_run_after` drops the rows it
wrote after that state, so nothing is lost or duplicated, and (the step being deterministic)
the recomputed rows equal the dropped ones. A run is trained (and resumed) under its lock
(:func:`run_lock`: one process per run), and ends `finished`, `cancelled` (interrupted) or
`failed`, never left `running` by a process that is gone but was not SIGKILLed.
:func:`report_run` writes a run's curves and summary
from what it recorded (`casi report run`, and `casi train` at the end).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import PolicyKind, PolicyVersion, RunStatus
from app.reports.run import write_run_report
from app.runtime import Retrieval
from app.training.evaluate import EvalRequest, evaluate_and_store
from app.training.policy_loader import LoadedPolicy
from app.training.splits import train_val_ids
from app.training.step import credit_records
from app.training.trackers import ReportTo, Trackers, TrackerSpec, flat_params, open_trackers
from evaluator.locks import holder_text, lock_if_free
from evaluator.scorers import SetScorer
from policy.checkpoint import load_state, save_state, state_step
from policy.evaluate import EvalResult
from policy.train_config import TrainConfig
from policy.trainer import StepResult, Trainer, query_order

log = logging.getLogger(__name__)

StepCallback = Callable[[StepResult], None]
EvalCallback = Callable[[int, EvalResult], None]


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


def run_training(
    factory: sessionmaker[Session],
    retrieval: Retrieval,
    scorer: SetScorer,
    policy: LoadedPolicy,
    cfg: TrainConfig,
    handle: RunHandle,
    eval_request: EvalRequest | None,
    *,
    reference: torch.nn.Module | None = None,
    on_step: StepCallback | None = None,
    on_eval: EvalCallback | None = None,
    rank: int = 0,
    world_size: int = 1,
    report_to: ReportTo | None = None,
) -> Trainer:
    """Train from ``handle.start_step`` to ``cfg.steps``; only rank 0 writes records and files
    (and feeds the trackers of ``report_to``)."""
    with run_lock(handle) if rank == 0 else nullcontext():
        return _train_locked(
            factory, retrieval, scorer, policy, cfg, handle, eval_request, reference=reference,
            on_step=on_step, on_eval=on_eval, rank=rank, world_size=world_size,
            report_to=report_to,
        )  # fmt: skip


def _train_locked(
    factory: sessionmaker[Session],
    retrieval: Retrieval,
    scorer: SetScorer,
    policy: LoadedPolicy,
    cfg: TrainConfig,
    handle: RunHandle,
    eval_request: EvalRequest | None,
    *,
    reference: torch.nn.Module | None,
    on_step: StepCallback | None,
    on_eval: EvalCallback | None,
    rank: int,
    world_size: int,
    report_to: ReportTo | None,
) -> Trainer:
    writer: _Writer | None = None
    try:
        torch.manual_seed(cfg.seed)
        trainer = Trainer(
            policy.model, policy.tokenizer, cfg, retrieval.executor, scorer,
            reference=reference, version=policy.version, world_size=world_size,
        )  # fmt: skip
        if handle.start_step > 0:
            trainer.load_state_dict(load_state(handle.state_dir))
        train_ids, _ = train_val_ids(retrieval.dataset)
        writer = _Writer(factory, handle, policy, cfg, report_to) if rank == 0 else None
        if (
            handle.start_step == 0
            and eval_request is not None
            and writer is not None
            and not handle.skip_start_eval
        ):
            writer.evaluate(trainer, 0, eval_request, on_eval)
        while trainer.step < cfg.steps:
            ids = query_order(train_ids, cfg.seed, trainer.step, cfg.queries * world_size)
            ids = ids[rank * cfg.queries : (rank + 1) * cfg.queries]  # this rank's share
            result = trainer.train_step([(q, retrieval.dataset.queries[q]) for q in ids])
            if writer is not None:
                writer.record(result)
                step = trainer.step
                due_eval = eval_request is not None and (
                    step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0)
                )
                if due_eval and eval_request is not None:
                    writer.evaluate(trainer, step, eval_request, on_eval)
                elif step == cfg.steps or (
                    cfg.checkpoint_every and step % cfg.checkpoint_every == 0
                ):
                    writer.checkpoint(trainer, step)
                if step % cfg.state_every == 0 or step == cfg.steps:
                    save_state(trainer.state_dict(), handle.state_dir)
            if on_step is not None:
                on_step(result)
    except BaseException as exc:  # killed or failed: the run and its trackers' runs end so
        if rank == 0:
            end_run(factory, handle.run_id, exc)
        if writer is not None:
            writer.trackers.close("failed")
        raise
    if writer is not None:
        writer.finish()
    return trainer


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


class _Writer:
    """Rank 0's records: metrics (DB + JSONL, then the trackers), credit records, checkpoints,
    evaluations."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        handle: RunHandle,
        policy: LoadedPolicy,
        cfg: TrainConfig,
        report_to: ReportTo | None = None,
    ) -> None:
        self.factory, self.handle, self.policy, self.cfg = factory, handle, policy, cfg
        self.trackers = self._open_trackers(report_to)

    def _open_trackers(self, report_to: ReportTo | None) -> Trackers:
        """The run's trackers, given its stored config (the same on a resume) as parameters."""
        if report_to is None or not report_to.names:
            return Trackers({}, self.handle.run_id)
        with session_scope(self.factory) as session:
            run = repo.get_run(session, self.handle.run_id)
            name = run.name if run is not None else f"run-{self.handle.run_id}"
            config = dict(run.config) if run is not None else {}
        spec = TrackerSpec(
            self.handle.run_id, name, self.handle.folder, report_to.var_dir,
            self.handle.start_step, report_to.group,
        )  # fmt: skip
        trackers = open_trackers(report_to, spec)
        trackers.log_params(flat_params(config))
        return trackers

    def record(self, result: StepResult) -> None:
        with session_scope(self.factory) as session:
            repo.add_step_metrics(
                session, self.handle.run_id, result.step, result.metrics, accepted=result.accepted
            )
            repo.add_credit_records(
                session, credit_records(result, self.handle.run_id, result.step)
            )
        line = {"step": result.step, "accepted": result.accepted, **result.metrics}
        with self.handle.metrics_path.open("a") as fh:
            fh.write(json.dumps(line) + "\n")
        self.trackers.log_metrics(result.metrics, result.step)

    def checkpoint(
        self, trainer: Trainer, step: int, held_out: dict[str, float] | None = None
    ) -> int:
        return checkpoint_run(
            self.factory, self.handle, self.policy, self.cfg, trainer, step, held_out
        )

    def evaluate(
        self, trainer: Trainer, step: int, request: EvalRequest, on_eval: EvalCallback | None
    ) -> None:
        """Held-out evaluation of the current weights, stored against their policy version."""
        result = evaluate_and_store(
            self.factory, trainer.model, self.policy.tokenizer, request,
            policy_version_id=None, run_id=self.handle.run_id, step=step,
            register=lambda metrics: self._version_for_eval(trainer, step, metrics),
        )  # fmt: skip
        self.handle.evaluations[step] = result.metrics
        held_out = {f"eval/{request.split}/{k}": v for k, v in result.metrics.items()}
        self.trackers.log_metrics(held_out, step)
        if on_eval is not None:
            on_eval(step, result)

    def _version_for_eval(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> int:
        if step == 0 and self.handle.policy_version_id is not None:
            return self.handle.policy_version_id  # the starting policy is already registered
        return self.checkpoint(trainer, step, metrics)

    def finish(self) -> None:
        with session_scope(self.factory) as session:
            repo.finish_run(session, self.handle.run_id, status=RunStatus.FINISHED)
        self.trackers.close("finished")


def checkpoint_run(
    factory: sessionmaker[Session],
    handle: RunHandle,
    policy: LoadedPolicy,
    cfg: TrainConfig,
    trainer: Trainer,
    step: int,
    held_out: dict[str, float] | None = None,
) -> int:
    """Save the weights under the run folder and register them as a policy version (its id).
    The checkpoint this run already wrote at ``step`` is reused, not written again."""
    folder = handle.folder / "checkpoints" / f"step-{step}"
    done = handle.last_checkpoint
    if done is not None and done[1] == folder and not held_out:
        with session_scope(factory) as session:
            row = repo.get_policy_version_by_version(session, done[0])
            if row is not None:
                return row.id
    base_path = policy.path if Path(policy.path).exists() else None  # None: the default
    version = trainer.export_policy(folder, base_path, policy.version)
    handle.last_checkpoint = (version, folder)
    with session_scope(factory) as session:
        pv = repo.get_or_add_policy_version(
            session, version=version, name=f"run-{handle.run_id}-step-{step}",
            base_model=policy.base_model, path=str(folder), kind=PolicyKind.TRAINED,
            step=step, parent_id=handle.policy_version_id,
            meta={"run_id": handle.run_id, "preset": cfg.preset, "held_out": held_out or {}},
        )  # fmt: skip
        if pv.run_id is None and pv.kind == PolicyKind.TRAINED.value:
            pv.run_id = handle.run_id  # a new version; unchanged weights keep their row
        if held_out:
            pv.meta = {**pv.meta, "held_out": held_out}
        return pv.id


def report_run(factory: sessionmaker[Session], run_id: int, out: Path) -> tuple[Path, Path]:
    """The run's curves and summary (`app.reports.run`) from the database; LookupError for an
    unknown run."""
    with session_scope(factory) as session:
        run = repo.get_run(session, run_id)
        if run is None:
            raise LookupError(f"no training run {run_id} (see `casi report runs`)")
        info = {"id": run.id, "name": run.name, "status": run.status, "preset": run.preset,
                "config": dict(run.config)}  # fmt: skip
        steps = [
            {"step": s.step, "metrics": dict(s.metrics)}
            for s in repo.step_metrics_for_run(session, run_id)
        ]
        evals = [{"step": e.step, "split": e.split, "n_queries": e.n_queries, "metrics": dict(e.metrics)}
                 for e in repo.evaluations_for_run(session, run_id)]  # fmt: skip
    return write_run_report(info, steps, evals, out)


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
