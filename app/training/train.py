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
the recomputed rows equal the dropped ones. A run is trained under its lock and ends `finished`,
`cancelled` (interrupted) or `failed`, never left `running` by a process that is gone but was
not SIGKILLed; opening, resuming and locking a run are `app.training.runs`. :func:`report_run`
writes a run's curves and summary from what it recorded (`casi report run`, and `casi train` at
the end).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import PolicyKind, RunStatus
from app.reports.run import write_run_report
from app.runtime import Retrieval
from app.training.evaluate import EvalRequest, evaluate_and_store
from app.training.policy_loader import LoadedPolicy
from app.training.policy_prompt import PROMPT_FILE, prompt_of
from app.training.runs import RunHandle, end_run, run_lock
from app.training.splits import train_val_ids
from app.training.step import credit_records
from app.training.trackers import ReportTo, Trackers, TrackerSpec, flat_params, open_trackers
from evaluator.scorers import SetScorer
from policy.checkpoint import load_state, save_state
from policy.evaluate import EvalResult
from policy.train_config import TrainConfig
from policy.trainer import StepResult, Trainer, query_order

StepCallback = Callable[[StepResult], None]
EvalCallback = Callable[[int, EvalResult], None]


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
    writer: _Writer | None = None
    with run_lock(handle) if rank == 0 else nullcontext():  # one process per run
        try:
            torch.manual_seed(cfg.seed)
            trainer = Trainer(
                policy.model, policy.tokenizer, cfg, retrieval.executor, scorer,
                reference=reference, version=policy.version, world_size=world_size,
                feedback=retrieval.feedback().contexts if cfg.rollout.needs_context else None,
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
    extra = {PROMPT_FILE: prompt_of(cfg.rollout).file_text()}  # served as it was trained
    version = trainer.export_policy(folder, base_path, policy.version, extra)
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
