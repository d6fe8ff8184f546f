"""``casi train`` (a training run, resumable) and ``casi eval`` (held-out retrieval of a policy).

Each command is a composition root: settings → database (checked and migrated first, so a bad
database fails in seconds, not after the work) → retrieval stack → scorer → policy → service.
"""

from __future__ import annotations

import os
import shlex
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.distributed as dist
import typer
from rich.markup import escape
from rich.table import Table
from sqlalchemy.orm import Session, sessionmaker

from app.cli.common import (
    MaxDocsOpt,
    PolicyOpt,
    ReportToOpt,
    fail,
    open_database,
    print_evaluation,
    resolve_precisions,
    trackers_or_fail,
)
from app.cli.options import config_or_fail, given_options, refuse_idle, with_config_options
from app.cli.train_display import TrainDisplay
from app.db import repositories as repo
from app.db import session_scope
from app.errors import redact
from app.limits import MAX_RECORD_ID
from app.progress import console, index_progress
from app.runtime import Retrieval, build_retrieval, build_scorer, check_evaluator
from app.settings import Settings, get_settings
from app.training.evaluate import (
    EvalRequest,
    evaluate_and_store,
    held_out_request,
    run_file_problem,
    run_request,
    run_tags,
    write_trec_run,
)
from app.training.policy_loader import LoadedPolicy, load_policy_ref
from app.training.runs import (
    RunHandle,
    check_index_and_reference,
    check_start,
    load_run,
    open_run,
    pin_index_and_reference,
    pin_start,
    resume_run,
    run_lock,
)
from app.training.splits import check_split
from app.training.trackers import ReportTo
from app.training.train import report_run, run_training
from evaluator.scorers import SetScorer
from policy.config_tree import config_options
from policy.params import check_params
from policy.rollout import RolloutConfig
from policy.train_config import TrainConfig

Opt = typer.Option


def _distributed(device: str) -> tuple[int, int, str]:
    """(rank, world size, this rank's device): under torchrun (WORLD_SIZE > 1) the process group
    is started here, nccl with one GPU per rank (LOCAL_RANK) when training on CUDA, else gloo;
    otherwise (0, 1, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, device
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), world, device


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@with_config_options(TrainConfig.options())
def train(
    preset: Annotated[str, Opt(help="Loss-stack preset (configs/*.toml) or a path.")] = "casi",
    evaluator: Annotated[
        str, Opt(help="Training evaluator: replay | surrogate | cosine.")
    ] = "replay",
    policy: PolicyOpt = None,
    resume: Annotated[
        int | None,
        Opt("--resume", min=1, max=MAX_RECORD_ID, help="Continue run RUN (after a kill) exactly."),
    ] = None,
    name: Annotated[str | None, Opt(help="Run name (default train-<preset>).")] = None,
    report_to: ReportToOpt = None,
    max_docs: MaxDocsOpt = None,
    **given: Any,
) -> None:
    """Train the rewrite policy: cached actions → ONE credit call → shaped advantages → loss
    stack → AdamW (+ MIPU) per step; metrics to the database and JSONL (and --report-to's
    trackers); checkpoints; held-out eval.

    Every option after --max-docs is a field of the training configuration (policy/train_config.py:
    its docstring is the help; its section validates it)."""
    settings = get_settings()
    trackers = trackers_or_fail(report_to, settings)
    overrides = given_options(given)
    if resume is not None:
        ignored = [f"--{k.replace('_', '-')}" for k in overrides] + [
            flag
            for flag, value, default in (
                ("--preset", preset, "casi"), ("--evaluator", evaluator, "replay"),
                ("--policy", policy, None), ("--name", name, None),
                ("--max-docs", max_docs, None),
            )
            if value != default
        ]  # fmt: skip
        if ignored:
            fail(
                f"--resume {resume} continues the run with the settings it started with; "
                f"{', '.join(ignored)} would be ignored — drop them, or start a new run"
            )
    overrides["precision"], overrides["train_precision"] = resolve_precisions(
        overrides.get("precision"), overrides.get("train_precision"), settings
    )
    overrides["list_k"] = settings.list_k
    with ExitStack() as held:
        try:
            rank, world, device = _distributed(settings.resolved_device())
            factory = open_database(settings)
            if rank == 0 and resume is not None:
                # the run's lock first: a second process is refused before it loads anything
                handle = RunHandle(resume, settings.var_dir / "runs" / str(resume))
                held.enter_context(run_lock(handle))
                handle, cfg, meta = load_run(factory, settings.var_dir, resume)
            elif rank == 0:
                cfg = config_or_fail(lambda: TrainConfig.from_preset(preset, **overrides), "train")
                refuse_idle(cfg.idle_options(given_options(given)), "train")
                check_evaluator(evaluator, settings)  # before the corpus is embedded
                meta = {"policy": policy, "evaluator": evaluator, "max_docs": max_docs,
                        "retrieval": retrieval_settings(settings)}  # fmt: skip
            if world > 1:  # every rank trains with rank 0's config (the frozen tree itself)
                cfg, meta = _broadcast((cfg, meta) if rank == 0 else None)
            # the game a run started in, whatever the environment says now (a run stored before
            # the stemmer setting existed had the unstemmed index): its settings, its list_k,
            # and on a resume exactly its slice (None: the whole corpus; neither the slice
            # `casi index build` built last nor CASI_MAX_DOCS)
            settings = settings.model_copy(
                update={**stored_retrieval(meta), "list_k": cfg.list_k}
                | ({"max_docs": None} if resume is not None else {})
            )
            with console.status("loading data, index and Redis"):
                r = build_retrieval(
                    settings, max_docs=meta["max_docs"], progress_factory=index_progress,
                    use_default_slice=resume is None,
                )  # fmt: skip
            scorer = build_scorer(meta["evaluator"], settings, r, split="train")
            eval_req = run_request(r, cfg) if cfg.eval.queries and rank == 0 else None
            with console.status("loading the policy"):
                pol = load_policy_ref(meta["policy"], settings.var_dir, factory, device=device)
                ref_pol = (
                    load_policy_ref(cfg.reference, settings.var_dir, factory, device=device)
                    if cfg.reference
                    else None
                )
            ref = ref_pol.model if ref_pol is not None else None
            check_params(pol.model, cfg.params)  # before a run is opened: a misfit is one line
            if rank == 0 and resume is None:
                meta["max_docs"] = r.max_docs  # the slice actually used: a resume rebuilds it
                pin_start(meta, pol)  # the version hash, not "warmstart": a resume loads the same
                pin_index_and_reference(
                    meta, r, ref_pol
                )  # the index and the KL reference a resume must find
                handle = open_run(factory, settings.var_dir, cfg, pol, name, meta)
                held.enter_context(run_lock(handle))
            elif rank == 0:
                check_start(factory, handle, pol, meta["policy"])
                check_index_and_reference(handle, meta, r, ref_pol, cfg.reference)
                handle, cfg, meta = resume_run(
                    factory, settings.var_dir, handle.run_id
                )  # drops now
            if world > 1:
                handle = _broadcast(handle if rank == 0 else None)
        except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
            fail(str(exc))
        _train(factory, r, scorer, pol, cfg, handle, eval_req, ref, meta, trackers, rank, world)
    if rank != 0:
        return
    _report(factory, settings, cfg, handle, meta.get("max_docs"))


def _train(
    factory: sessionmaker[Session], r: Retrieval, scorer: SetScorer, pol: LoadedPolicy,
    cfg: TrainConfig, handle: RunHandle, eval_req: EvalRequest | None,
    ref: torch.nn.Module | None, meta: dict[str, Any], trackers: ReportTo, rank: int, world: int,
) -> None:  # fmt: skip
    """The run itself, under its lock (rank 0), with its display."""
    if rank == 0:
        console.print(
            f"run [bold]{handle.run_id}[/] ({cfg.preset}, {meta['evaluator']}, anchor {'on' if cfg.anchor_query else 'off'}, "
            f"credit {cfg.shaping.credit}): {cfg.steps} steps × {cfg.queries} queries × {cfg.samples} samples × "
            f"m={cfg.n_actions}{f' × {world} ranks' if world > 1 else ''}; policy {pol.version}; "
            f"index {r.index.version} ({len(r.index)} docs)"
            + (f"; resuming after step {handle.start_step}" if handle.start_step else "")
        )
    with TrainDisplay(cfg, handle.start_step, quiet=rank != 0) as display:
        run_training(
            factory, r, scorer, pol, cfg, handle, eval_req, reference=ref,
            on_step=display.step, on_eval=display.evaluation, rank=rank, world_size=world,
            report_to=trackers,
        )  # fmt: skip
    if world > 1:
        dist.destroy_process_group()


def _report(
    factory: sessionmaker[Session], settings: Settings, cfg: TrainConfig, handle: RunHandle,
    max_docs: int | None = None,
) -> None:  # fmt: skip
    """The end of a run: before → after, its report, where its final policy is."""
    if len(handle.evaluations) >= 2:
        print_before_after(handle.evaluations, cfg, query_word(settings.dataset))
    png, md = report_run(
        factory, handle.run_id, settings.var_dir / "reports" / f"run-{handle.run_id}"
    )
    console.print(
        f"[bold]done:[/] run {handle.run_id} recorded in {redact(settings.sqlalchemy_url)}; "
        f"metrics {handle.metrics_path}; curves {png}; summary {md}"
    )
    if handle.last_checkpoint is not None:
        version, folder = handle.last_checkpoint
        kind = "LoRA adapter" if cfg.params.kind == "lora" else "weights"
        env = " ".join(run_environment(settings, max_docs))
        console.print(f"final policy: version [bold]{version}[/] ({kind}) in {escape(str(folder))}")
        guarded = bool(cfg.eval.refuse_degenerate)  # the pasted eval decodes as the run's did
        for line in next_commands(version, env, cfg.rollout, guarded):  # one line each: pasted
            console.print(escape(line), soft_wrap=True)


def run_environment(settings: Settings, max_docs: int | None = None) -> list[str]:
    """``CASI_<NAME>=value`` for each of the run's settings that is not its default (and
    ``CASI_MAX_DOCS`` for a run on a slice), quoted for a POSIX shell: put in front of a
    command, it runs in the run's var folder and game whatever the shell has exported."""
    out = []
    for name in RUN_ENVIRONMENT:
        value = getattr(settings, name)
        if value != Settings.model_fields[name].default:
            out.append(f"CASI_{name.upper()}={shlex.quote(str(value))}")
    if max_docs is not None:
        out.append(f"CASI_MAX_DOCS={max_docs}")
    return out


def next_commands(
    version: str, env: str, rollout: RolloutConfig, guarded: bool = False
) -> list[str]:
    """What to do with a run's final policy, as commands that work pasted: evaluate it (in the
    run's rollout shape: its prompt style, m, format; with serving's degenerate guard when the
    run's held-out evaluations had it, ``guarded``, so its numbers are the run's) and serve it,
    in the run's environment."""
    shape = [
        f"--{o.flag} {shlex.quote(str(value))}"
        for o in config_options(RolloutConfig)
        if (value := getattr(rollout, o.name)) != o.default and value is not None
    ]
    if guarded:
        shape.append("--refuse-degenerate")
    prefix = f"{env} " if env else ""
    evaluate = " ".join(["casi eval --policy", version, "--split test --queries 100", *shape])
    return [
        f"  evaluate it: {prefix}{evaluate}",
        f"  serve it:    CASI_API_POLICY={version} {prefix}casi serve",
        f"               (or POST /v1/policies/{version}/activate on a server in that environment)",
    ]


def query_word(dataset: Path) -> str:
    """What a dataset's queries are called in tables: SciFact's are claims."""
    return "claims" if Path(dataset).name.lower().startswith("scifact") else "queries"


def print_before_after(
    evals: dict[int, dict[str, float]], cfg: Any, queries: str = "queries"
) -> None:
    """Held-out numbers at the first and the last evaluation of the run, side by side
    (``queries``: what the dataset's queries are called, :func:`query_word`)."""
    first, last = min(evals), max(evals)
    a, b = evals[first], evals[last]
    table = Table(
        title=f"held-out {cfg.eval.split} ({cfg.eval.queries} {queries}): before (step {first}) → after (step {last})"
    )
    for col in ("", "before", "after", "change"):
        table.add_column(col, justify="left" if not col else "right")
    rows = (
        ("query alone nDCG@10", "query_ndcg@10"), ("query + rewrites nDCG@10", "combined_ndcg@10"),
        ("gain over the query, nDCG@10", "gain_ndcg@10"), ("query + rewrites recall@100", "combined_recall@100"),
        ("rewrites alone nDCG@10", "rewrites_ndcg@10"), ("well-formed", "well_formed"),
        ("duplicate rewrites", "duplicate_rate"), ("degenerate rewrites", "degenerate_rate"),
        # the pooled game (CASI_GAME=pool): graded recall of the pools, the baselines, overlap
        ("query + rewrites pool recall", "combined_pool_recall"),
        ("equal budget (query alone, depth (m + 1)·k)", "budget_pool_recall"),
        ("keyword expansion pool recall", "prf_pool_recall"),
        ("served nDCG@10 (the pool re-ranked)", "served_ndcg@10"),
        ("keyword expansion served nDCG@10", "prf_served_ndcg@10"),
        ("overlap between the rewrites' lists", "overlap"),
    )  # fmt: skip
    for label, key in rows:
        if key not in a or key not in b:  # an evaluation stored before the metric existed
            continue
        table.add_row(label, f"{a[key]:.4f}", f"{b[key]:.4f}", f"{b[key] - a[key]:+.4f}")
    console.print(table)


RETRIEVAL_SETTINGS = (
    "dataset",
    "game",
    "retriever",
    "merge",
    "rrf_k",
    "retrieval_k",
    "bm25_k1",
    "bm25_b",
    "bm25_stemmer",
    "bm25_rules",
)
"""The settings that make a run's game (its index, depth and merge rule): stored with the run,
restored on --resume."""
RUN_ENVIRONMENT = ("var_dir", *RETRIEVAL_SETTINGS, "list_k")
"""The settings a later `casi eval` / `casi serve` must share with a run to find its policy (the
var folder's database) and play its game (dataset, game, retriever, index, depth)."""


def retrieval_settings(settings: Settings) -> dict[str, Any]:
    return {name: str(v) if isinstance(v := getattr(settings, name), Path) else v
            for name in RETRIEVAL_SETTINGS}  # fmt: skip


def stored_retrieval(meta: dict[str, Any]) -> dict[str, Any]:
    """The settings update that puts a run back in its game: what it stored, else (a run stored
    before a setting existed) what that setting was then (the list game, the unstemmed index;
    a run that stored no dataset keeps the one the environment names; BM25 rules 1)."""
    stored = dict(meta.get("retrieval") or {"bm25_stemmer": "none"})
    if "dataset" in stored:
        stored["dataset"] = Path(stored["dataset"])
    return {"game": "list", "bm25_rules": 1, **stored}


@with_config_options(config_options(RolloutConfig))
def evaluate(
    policy: PolicyOpt = None,
    split: Annotated[str, Opt(help="test | val (validation slice of TRAIN) | train.")] = "test",
    queries: Annotated[
        int, Opt("--queries", min=1, help="The first N judged queries of the split.")
    ] = 100,
    max_docs: MaxDocsOpt = None,
    run_file: Annotated[
        Path | None,
        Opt(
            "--run-file",
            dir_okay=False,
            help="Also write the evaluated lists as a TREC run file (qid Q0 docid rank score "
            "tag), e.g. for trec_eval. Tags: query (the claim alone), rewrites (the rewrites "
            "fused), combined (query + rewrites fused: the list CASI serves) are the lists "
            "nDCG@10 is computed on (the game's fusion of depth-retrieval_k lists, cut to 10); "
            "query-100, rewrites-100, combined-100 are the depth-100 fusions recall@100 is "
            "computed on (under rrf their top 10 can differ). Score: the fused score (rrf sum, "
            "or best retrieval score under max), a tie lowered by one float32 ulp so that "
            "trec_eval keeps CASI's order. An existing file is replaced and keeps its mode; "
            "a device, pipe or symbolic link is refused, before any work.",
        ),
    ] = None,
    refuse_degenerate: Annotated[
        bool,
        Opt(
            "--refuse-degenerate",
            help="Decode as serving does: a rewrite line never becomes a string of repeats "
            "(greedy, constrained format; docs/methods.md §1.10). Off by default: rewrites are "
            "scored as the policy writes them.",
        ),
    ] = False,
    **given: Any,
) -> None:
    """Held-out retrieval of a policy: nDCG@10 / recall@100 of the query alone, the rewrites
    alone and query + rewrites (greedy float32 rewrites, constrained format by default); stored
    as an evaluation of that version, and written as a TREC run file with --run-file. The
    options after --run-file are the rollout shape (policy.rollout.RolloutConfig), the same as
    `casi train`'s."""
    settings = get_settings()
    t0 = time.perf_counter()
    if run_file is not None and (problem := run_file_problem(run_file)) is not None:
        fail(f"--run-file {run_file}: {problem}")  # before the evaluation's work
    try:
        rollout = config_or_fail(lambda: RolloutConfig(**given_options(given)), "eval")
        if refuse_degenerate and rollout.format != "constrained":
            raise ValueError(
                "--refuse-degenerate guards the constrained format only — drop --format free "
                "or --refuse-degenerate"
            )
        check_split(split, settings.dataset)  # before the database, the index, the model
        factory = open_database(settings)
        r = build_retrieval(settings, max_docs=max_docs, progress_factory=index_progress)
        request = held_out_request(r, rollout, split, queries, refuse_degenerate)
        with console.status("loading the policy"):
            pol = load_policy_ref(
                policy, settings.var_dir, factory, device=settings.resolved_device()
            )
        with session_scope(factory) as session:
            pv_id = repo.get_or_add_policy_version(
                session,
                version=pol.version,
                name=pol.name,
                base_model=pol.base_model,
                path=pol.path,
                kind=pol.kind,
            ).id
        with console.status(f"greedy rewrites for {queries} {split} queries, retrieval, scoring"):
            res = evaluate_and_store(
                factory, pol.model, pol.tokenizer, request, policy_version_id=pv_id
            )
        if run_file is not None:
            n_lines = write_trec_run(run_file, res, r.retriever.doc_ids, request.config)
    except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail(str(exc))
    print_evaluation(
        res.metrics,
        f"{split}: {res.n_queries} queries, policy {pol.version}, index {r.index.version} ({len(r.index)} docs)",
    )
    console.print(
        f"well-formed {res.metrics['well_formed']:.0%}; stored for version {pol.version}; {time.perf_counter() - t0:.0f}s"
    )
    if run_file is not None:
        tags = ", ".join(run_tags(request.config))
        console.print(f"TREC run file {run_file}: {n_lines} lines, tags {tags}")
