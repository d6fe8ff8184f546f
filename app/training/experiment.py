"""`casi experiment credit`: the credit-mode experiment, resumable, with tables, a plot and JSON.

Read :func:`run_experiment`. Every (mode, seed) cell trains from the SAME starting policy with
the same config except the credit mode: same seeds, so the same data order and the same first
rollouts, and the same compute (steps × queries × samples rollouts of m actions each); every
run is evaluated on the same held-out claims, through the ONE held-out path
(:func:`app.training.evaluate.evaluate_and_store`: greedy, float32) that `casi eval` and
`casi train` use — the starting policy once, shared by all cells, stored as an evaluation of
its version. The plan (`app.training.experiment_plan`) — cells and their run ids, the
retrieval environment (retriever, merge rule) and the machines it ran on — lives in
``var/experiments/<name>/plan.json``, written before each run starts: a killed experiment skips
finished cells and resumes the interrupted one exactly (`resume_run`). Every evaluation's per-claim rows land in
``per_query/<mode>-s<seed>.json`` (``start.json`` for the start) as it happens.

Results (:func:`app.training.experiment_results.write_results`): ``results.json``, ``table.md``
(`app.training.experiment_tables`) and ``ndcg.png``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.training.evaluate import evaluate_and_store, machine_info
from app.training.experiment_plan import (
    Cell,
    Plan,
    cell_key,
    drop_per_query_after,
    plain,
    save_per_query,
)
from app.training.experiment_results import write_results
from app.training.policy_loader import register_policy
from app.training.runs import open_run, resume_run
from app.training.trackers import ReportTo
from app.training.train import run_training
from evaluator.locks import holder_text, lock_if_free
from policy.train_config import TrainConfig


def _record_machine(plan: Plan) -> None:
    """Every machine the experiment ran on (a resume may be elsewhere), in order."""
    machines = plan.meta.setdefault("machines", [])
    here = plain(machine_info())
    if not machines or machines[-1] != here:
        machines.append(here)


def run_experiment(
    factory: sessionmaker[Session],
    var_dir: Path,
    folder: Path,
    plan: Plan,
    build: Callable[[], Any],
    *,
    on_cell: Callable[[Cell, int, int], None] | None = None,
    on_step: Callable[[Any], None] | None = None,
    on_eval: Callable[[int, Any], None] | None = None,
    report_to: ReportTo | None = None,
) -> dict[str, Any]:
    """Run (or finish) every cell. ``build()`` returns (retrieval, scorer, policy, eval request,
    restore) once; ``restore()`` puts the starting weights back before each cell. Each cell is
    one run of the trackers of ``report_to``. The experiment's lock (beside its plan.json, the
    holder's pid in it) is held throughout: a second process running the same experiment is
    refused, naming the holder (two would resume one cell's run and write one state)."""
    path = folder / "plan.json"
    with lock_if_free(path, record_holder=True) as free:
        if not free:
            raise ValueError(
                f"experiment {plan.name!r} is being run by another casi process "
                f"({holder_text(path)}): let it "
                "finish, or stop it and run this again to resume"
            )
        return _run_locked(factory, var_dir, folder, plan, build, on_cell=on_cell,
                           on_step=on_step, on_eval=on_eval, report_to=report_to)  # fmt: skip


def _run_locked(
    factory: sessionmaker[Session],
    var_dir: Path,
    folder: Path,
    plan: Plan,
    build: Callable[[], Any],
    *,
    on_cell: Callable[[Cell, int, int], None] | None,
    on_step: Callable[[Any], None] | None,
    on_eval: Callable[[int, Any], None] | None,
    report_to: ReportTo | None,
) -> dict[str, Any]:
    retrieval, scorer, policy, request, restore = build()
    path = folder / "plan.json"
    _record_machine(plan)
    plan.save(path)
    if plan.start_eval is None:  # the one held-out path, stored as an evaluation of the start
        result = evaluate_and_store(
            factory, policy.model, policy.tokenizer, request,
            policy_version_id=register_policy(factory, policy),
        )  # fmt: skip
        save_per_query(folder, "start", 0, result.per_query)
        plan.start_eval = result.metrics
        plan.save(path)
    for i, cell in enumerate(plan.cells):
        if cell.done:
            continue
        if on_cell is not None:
            on_cell(cell, i, len(plan.cells))
        restore()
        key = cell_key(cell.mode, cell.seed)
        if cell.run_id is None:
            cfg = TrainConfig.from_dict({**plan.config, "credit": cell.mode, "seed": cell.seed})
            handle = open_run(
                factory, var_dir, cfg, policy, f"{plan.name}-{cell.mode}-s{cell.seed}", plan.meta
            )
            cell.run_id = handle.run_id
            plan.save(path)
        else:
            handle, cfg, _ = resume_run(factory, var_dir, cell.run_id)
        handle.skip_start_eval = True
        drop_per_query_after(folder, key, handle.start_step)

        def evaluated(step: int, result: Any, key: str = key) -> None:
            save_per_query(folder, key, step, result.per_query)
            if on_eval is not None:
                on_eval(step, result)

        run_training(
            factory, retrieval, scorer, policy, cfg, handle, request,
            on_step=on_step, on_eval=evaluated, report_to=report_to,
        )  # fmt: skip
        cell.done = True
        plan.save(path)
    return write_results(factory, folder, plan)
