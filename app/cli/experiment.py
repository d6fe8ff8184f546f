"""``casi experiment credit``: does per-action Shapley credit train better than broadcast?"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from app.cli.common import (
    MaxDocsOpt,
    PolicyOpt,
    ReportToOpt,
    fail,
    open_database,
    resolve_precisions,
    trackers_or_fail,
)
from app.cli.options import config_or_fail, given_options, refuse_idle, with_config_options
from app.cli.train_display import TrainDisplay
from app.cli.units import aggregate_cmd, parse_seeds, run_protocol_cells
from app.cli.units_status import status_cmd
from app.progress import console, index_progress
from app.runtime import build_retrieval, build_scorer, check_evaluator
from app.settings import Settings, get_settings
from app.training.evaluate import held_out_request
from app.training.experiment import run_experiment
from app.training.experiment_plan import game_pins, make_plan, pin_game
from app.training.policy_loader import load_policy_ref, resolve_path
from app.training.splits import split_ids
from evaluator.corpus import load_dataset
from evaluator.retrievers import check_merge, check_retriever
from policy.train_config import TrainConfig

experiment_app = typer.Typer(
    help="Experiments that compare training configurations.", no_args_is_help=True
)
Opt = typer.Option
MAX_EXPERIMENT_ACTIONS = 8  # 256 coalitions per rollout
EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")  # var/experiments/<name>
DEFAULT_SEEDS = "0-4"
"""`--seeds` of a plain experiment when not given (with --protocol: the planned seeds)."""


def environment_settings(
    settings: Settings, retriever: str | None, merge: str | None, rrf_k: float | None
) -> tuple[Settings, dict[str, Any]]:
    """Settings with the experiment's retrieval environment, and that environment resolved
    (retriever, merge rule — ``auto`` becomes the retriever's default — and the rrf k)."""
    name = check_retriever(retriever or settings.retriever)
    rule = merge or settings.merge
    if rule != "auto":
        check_merge(rule)
    env = settings.model_copy(
        update={
            "retriever": name,
            "merge": rule,
            "rrf_k": settings.rrf_k if rrf_k is None else rrf_k,
        }
    )
    return env, {"retriever": name, "merge": env.resolved_merge(name), "rrf_k": float(env.rrf_k)}


def count_eval_queries(settings: Settings, split: str, asked: str) -> int:
    """``--eval-queries``: a number, or ``all`` (every judged query of the split: the whole TEST
    split is 300 SciFact claims)."""
    if asked.strip().lower() != "all":
        try:
            n = int(asked)
        except ValueError:
            raise ValueError(f"--eval-queries takes a number or 'all', got {asked!r}") from None
        if n < 1:
            raise ValueError(f"--eval-queries must be >= 1, got {n}")
        return n
    return len(split_ids(load_dataset(settings.dataset), split))


EXPERIMENT_DEFAULTS = {
    "queries": 8,
    "eval_every": 10,
    "precision": "auto",
    "train_precision": "auto",
    "prompt": "short",
}
"""The experiment's own defaults for training options (the rest: TrainConfig's)."""
EXPERIMENT_SETS = ("credit", "seed", "state_every", "eval_queries")
"""Training options the experiment sets itself: credit and seed per cell, the resume state at
every evaluation, and --eval-queries (a number or ``all``) declared here."""


@experiment_app.command("credit")
@with_config_options(TrainConfig.options(), defaults=EXPERIMENT_DEFAULTS, exclude=EXPERIMENT_SETS)
def credit_experiment(
    modes: Annotated[
        list[str] | None, Opt("--modes", help="Credit modes (repeat or space-separate).")
    ] = None,
    extra: Annotated[
        list[str] | None, typer.Argument(help="More modes after --modes", show_default=False)
    ] = None,
    seeds: Annotated[
        str | None,
        Opt(
            help="Seeds: a comma list of seeds and ranges of ASCII digits: 0 (seed 0 alone; "
            "3 is seed 3, not three seeds), 0,2,5, 0-4 (seeds 0 to 4), 0-2,7; at most 1000 "
            "seeds, each below 2^31. Default 0-4; with --protocol, the environment's planned "
            "seeds, and only those are accepted.",
            show_default=False,
        ),
    ] = None,
    protocol: Annotated[
        Path | None,
        Opt(
            help="A pre-registered protocol (TOML): run its cells (--environment, --modes, --seeds); "
            "the protocol fixes every training setting."
        ),
    ] = None,
    environment: Annotated[
        str | None, Opt(help="With --protocol: the environment whose cells to run.")
    ] = None,
    out: Annotated[
        Path | None,
        Opt(help="With --protocol: the results folder (default: the protocol file's folder)."),
    ] = None,
    stop_by: Annotated[
        str | None,
        Opt(
            "--stop-by",
            help="With --protocol: start a cell only if it should end by this local time "
            "(HH:MM, today or, if past, tomorrow; or an ISO date-time): 1.25 × the longest "
            "finished cell of this CPU family (of any machine, when this family has none). A "
            "seed with no finished cell is begun only if all its asked cells should end by "
            "then: its cells share one start, which another CPU's recipe may not make.",
            show_default=False,
        ),
    ] = None,
    eval_queries: Annotated[
        str, Opt(help="Held-out claims: N (the first N of the split) or all (the whole split).")
    ] = "100",
    retriever: Annotated[
        str | None, Opt(help="dense (MiniLM + FAISS) | bm25 (default CASI_RETRIEVER).")
    ] = None,
    merge: Annotated[
        str | None,
        Opt(help="Coalition merge: max | rrf | auto (the retriever's: max dense, rrf bm25)."),
    ] = None,
    rrf_k: Annotated[
        float | None,
        Opt("--rrf-k", min=0.0, max=100000.0, help="rrf constant k (default CASI_RRF_K, 60)."),
    ] = None,
    preset: Annotated[str, Opt(help="Loss-stack preset (configs/*.toml) or a path.")] = "casi",
    evaluator: Annotated[
        str, Opt(help="Training evaluator: replay | surrogate | cosine.")
    ] = "replay",
    policy: PolicyOpt = None,
    max_docs: MaxDocsOpt = None,
    name: Annotated[
        str, Opt(help="Experiment name: rerun the same command to resume it.")
    ] = "credit",
    report_to: ReportToOpt = None,
    **given: Any,
) -> None:
    """Train every credit mode × seed from the same policy with the same compute, evaluate on
    the same held-out claims (greedy float32, the `casi eval` path), write table.md (means,
    per-seed, paired bootstrap CIs / p-values), ndcg.png and results.json under
    var/experiments/<name>/ (resumable)."""
    settings = get_settings()
    if not EXPERIMENT_NAME.fullmatch(name):
        fail(
            f"--name {name!r} is not a folder name under var/experiments — use a letter or "
            "digit, then up to 99 letters, digits, _ . -"
        )
    asked = list(modes or []) + list(extra or [])
    trackers = trackers_or_fail(report_to, settings, group=name)
    if protocol is not None and trackers.names:
        fail("--report-to goes with plain experiment runs, not --protocol cells")
    if protocol is not None:
        fixed = {"retriever": retriever, "merge": merge, "rrf_k": rrf_k, "policy": policy,
                 "max_docs": max_docs, "preset": None if preset == "casi" else preset,
                 "evaluator": None if evaluator == "replay" else evaluator}  # fmt: skip
        user_set = {
            k: v for k, v in given_options(given).items() if EXPERIMENT_DEFAULTS.get(k) != v
        }
        user_set.update({k: v for k, v in fixed.items() if v is not None})
        run_protocol_cells(
            settings, protocol, environment, asked, seeds, out, user_set, stop_by=stop_by
        )
        return
    if environment is not None or out is not None or stop_by is not None:
        fail("--environment, --out and --stop-by go with --protocol")
    try:
        seed_list = parse_seeds(DEFAULT_SEEDS if seeds is None else seeds)
    except ValueError as exc:
        fail(f"{exc} — `casi experiment credit --help`")
    chosen = asked or ["broadcast", "shuffled", "singleton", "leave_one_out", "shapley"]
    folder = settings.var_dir / "experiments" / name
    try:
        env_settings, env = environment_settings(settings, retriever, merge, rrf_k)
        overrides = {**EXPERIMENT_DEFAULTS, **given_options(given)}
        overrides["precision"], overrides["train_precision"] = resolve_precisions(
            overrides["precision"], overrides["train_precision"], settings
        )  # auto resolved
        factory = open_database(settings)
        split = overrides.get("eval_split", "test")
        cfg = config_or_fail(
            lambda: TrainConfig.from_preset(
                preset, **overrides, list_k=settings.list_k,
                eval_queries=count_eval_queries(settings, split, eval_queries),
            ),
            "experiment credit",
        )  # fmt: skip
        refuse_idle(cfg.idle_options(given_options(given)), "experiment credit")
        # the resume state at every evaluation (a killed cell resumes there)
        cfg = dataclasses.replace(cfg, state_every=max(1, cfg.eval.every or cfg.steps))
        if cfg.n_actions > MAX_EXPERIMENT_ACTIONS:
            fail(
                f"--n-actions must be in 1..{MAX_EXPERIMENT_ACTIONS} for the experiment, got "
                f"{cfg.n_actions} — exact Shapley scores 2^m coalitions per rollout; use m <= 8"
            )
        for mode in chosen:
            TrainConfig.from_preset(preset, credit=mode)  # a bad mode fails now, not after hours
        check_evaluator(evaluator, settings)  # before the plan is saved: a typo never pins it
        resolve_path(policy, factory)
        plan = make_plan(
            folder,
            name,
            chosen,
            seed_list,
            cfg,
            {"policy": policy, "evaluator": evaluator, "max_docs": max_docs, **env},
        )
        for key, old in (("retriever", "dense"), ("merge", "max"), ("rrf_k", 60.0)):
            plan.meta.setdefault(key, old)  # an experiment stored before these existed
        env_settings, _ = environment_settings(
            settings, plan.meta["retriever"], plan.meta["merge"], plan.meta["rrf_k"]
        )
    except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail(str(exc))

    def build() -> tuple[Any, ...]:
        r = build_retrieval(
            env_settings, max_docs=plan.meta["max_docs"], progress_factory=index_progress,
            retriever=plan.meta["retriever"],
        )  # fmt: skip
        plan.meta["max_docs"] = r.max_docs
        pin_game(plan, game_pins(r, env_settings))
        scorer = build_scorer(plan.meta["evaluator"], env_settings, r, split="train")
        stored = TrainConfig.from_dict(plan.config)
        request = held_out_request(r, stored.rollout, stored.eval.split, stored.eval.queries)
        pinned = plan.meta.get("policy_version")  # resolved once: a resume trains from it
        pol = load_policy_ref(
            pinned or plan.meta["policy"], settings.var_dir, factory,
            device=settings.resolved_device(),
        )  # fmt: skip
        if pinned is not None and pol.version != pinned:
            raise ValueError(
                f"experiment {name!r} started from policy {pinned}, which now loads as {pol.version}"
            )
        plan.meta["policy_version"] = pol.version
        start = {k: v.clone() for k, v in pol.model.state_dict().items()}
        return r, scorer, pol, request, lambda: pol.model.load_state_dict(start)

    displays: list[TrainDisplay] = []

    def on_cell(cell: Any, i: int, n: int) -> None:
        for d in displays:
            d.__exit__(None, None, None)
        displays.clear()
        console.rule(f"cell {i + 1}/{n}: credit {cell.mode}, seed {cell.seed}")
        displays.append(TrainDisplay(TrainConfig.from_dict(plan.config), 0).__enter__())

    console.print(
        f"experiment [bold]{name}[/]: {', '.join(chosen)} × seeds {seed_list}; retriever {plan.meta['retriever']}, "
        f"merge {plan.meta['merge']}; {cfg.steps} steps × {cfg.queries} queries × {cfg.samples} samples × "
        f"m={cfg.n_actions}; held-out {cfg.eval.queries} {cfg.eval.split} claims"
    )
    try:
        results = run_experiment(
            factory, settings.var_dir, folder, plan, build, on_cell=on_cell,
            on_step=lambda r: displays[-1].step(r),
            on_eval=lambda s, r: displays[-1].evaluation(s, r) if displays else None,
            report_to=trackers,
        )  # fmt: skip
    except (ValueError, FileNotFoundError, LookupError) as exc:
        fail(str(exc))
    finally:
        for d in displays:
            d.__exit__(None, None, None)
    console.print((folder / "table.md").read_text())
    console.print(
        f"results: {folder / 'results.json'}, plot: {folder / 'ndcg.png'} ({len(results['curves'])} runs)"
    )


experiment_app.command("aggregate")(aggregate_cmd)
experiment_app.command("status")(status_cmd)
