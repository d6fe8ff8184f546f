"""``casi train`` (a training run, resumable) and ``casi eval`` (held-out retrieval of a policy).

Each command is a composition root: settings → database (checked and migrated first, so a bad
database fails in seconds, not after the work) → retrieval stack → scorer → policy → service.
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Any

import torch
import torch.distributed as dist
import typer
from rich.table import Table

from app.cli.common import (
    FormatOpt,
    LineCapOpt,
    MaxDocsOpt,
    MaxNewTokensOpt,
    PolicyOpt,
    fail,
    open_database,
    print_evaluation,
    resolve_precisions,
)
from app.cli.train_display import TrainDisplay
from app.db import repositories as repo
from app.db import session_scope
from app.errors import redact
from app.progress import console, index_progress
from app.runtime import build_retrieval, build_scorer
from app.settings import get_settings
from app.training.evaluate import evaluate_and_store, held_out_request
from app.training.policy_loader import load_policy_ref
from app.training.train import open_run, report_run, resume_run, run_training
from evaluator.limits import MAX_PLAYERS
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


def train(
    preset: Annotated[str, Opt(help="Loss-stack preset (configs/*.toml) or a path.")] = "casi",
    steps: Annotated[int | None, Opt(min=1, help="Optimizer steps.")] = None,
    queries: Annotated[
        int | None, Opt("--queries", min=1, help="B: train queries per step.")
    ] = None,
    samples: Annotated[int | None, Opt("--samples", min=2, help="G: samples per query.")] = None,
    n_actions: Annotated[
        int | None, Opt("--n-actions", min=1, max=MAX_PLAYERS, help="m: rewrites per generation.")
    ] = None,
    evaluator: Annotated[
        str, Opt(help="Training evaluator: replay | surrogate | cosine.")
    ] = "replay",
    policy: PolicyOpt = None,
    seed: Annotated[int | None, Opt(help="Seeds data order, sampling and torch.")] = None,
    resume: Annotated[
        int | None, Opt("--resume", help="Continue run RUN (after a kill) exactly.")
    ] = None,
    name: Annotated[str | None, Opt(help="Run name (default train-<preset>).")] = None,
    max_docs: MaxDocsOpt = None,
    lr: Annotated[float | None, Opt(min=0.0)] = None,
    credit: Annotated[
        str | None,
        Opt(help="Override the preset's credit: shapley | singleton | leave_one_out | broadcast."),
    ] = None,
    anchor: Annotated[
        bool | None, Opt("--anchor/--no-anchor", help="The query as an anchor player (default on).")
    ] = None,
    eval_every: Annotated[
        int | None, Opt(min=0, help="Held-out evaluation every N steps (and at start and end).")
    ] = None,
    eval_queries: Annotated[
        int | None, Opt(min=0, help="Held-out TEST claims per evaluation (0 = none).")
    ] = None,
    eval_split: Annotated[
        str | None, Opt(help="test | val (the validation slice of TRAIN).")
    ] = None,
    checkpoint_every: Annotated[int | None, Opt(min=0)] = None,
    state_every: Annotated[
        int | None, Opt(min=1, help="Save the resume state every N steps.")
    ] = None,
    precision: Annotated[
        str | None,
        Opt(help="Sampler: float32 | bfloat16 | int8 | int8_weight | auto (bf16 where native)."),
    ] = None,
    train_precision: Annotated[
        str | None,
        Opt(help="Training forward: float32 | bfloat16 (autocast) | auto (bf16 where native)."),
    ] = None,
    prompt: Annotated[
        str | None, Opt(help="oneshot | short (for a format-trained policy).")
    ] = None,
    temperature: Annotated[float | None, Opt(min=0.01)] = None,
    format: FormatOpt = None,
    line_cap: LineCapOpt = None,
    max_new_tokens: MaxNewTokensOpt = None,
    params: Annotated[
        str | None,
        Opt(help="Which weights train: full | lora (adapters; base frozen) | top (top N layers)."),
    ] = None,
    lora_rank: Annotated[int | None, Opt(min=1, help="LoRA rank r (--params lora).")] = None,
    lora_alpha: Annotated[float | None, Opt(min=0.0, help="LoRA alpha (scale alpha/r).")] = None,
    lora_dropout: Annotated[float | None, Opt(min=0.0, max=0.99)] = None,
    top_layers: Annotated[
        int | None, Opt(min=1, help="N of --params top: the last N layers train.")
    ] = None,
    micro_batch_size: Annotated[int | None, Opt(min=1)] = None,
    mini_batches: Annotated[int | None, Opt(min=1)] = None,
    schedule: Annotated[str | None, Opt(help="constant | linear | cosine.")] = None,
    warmup_steps: Annotated[int | None, Opt(min=0)] = None,
    reference: Annotated[
        str | None, Opt(help="KL reference policy (default: the starting policy).")
    ] = None,
) -> None:
    """Train the rewrite policy: cached actions → ONE credit call → shaped advantages → loss
    stack → AdamW (+ MIPU) per step; metrics to the database and JSONL; checkpoints; held-out eval."""
    settings = get_settings()
    precision, train_precision = resolve_precisions(precision, train_precision, settings)
    overrides = dict(
        steps=steps, queries=queries, samples=samples, n_actions=n_actions, seed=seed, lr=lr,
        credit=credit, anchor_query=anchor, eval_every=eval_every, eval_queries=eval_queries,
        eval_split=eval_split, checkpoint_every=checkpoint_every, state_every=state_every,
        precision=precision, train_precision=train_precision, prompt=prompt, temperature=temperature,
        max_new_tokens=max_new_tokens, micro_batch_size=micro_batch_size, mini_batches=mini_batches,
        format=format, line_cap=line_cap, params=params, lora_rank=lora_rank,
        lora_alpha=lora_alpha, lora_dropout=lora_dropout, top_layers=top_layers,
        schedule=schedule, warmup_steps=warmup_steps, reference=reference, list_k=settings.list_k,
    )  # fmt: skip
    try:
        rank, world, device = _distributed(settings.resolved_device())
        factory = open_database(settings)
        if rank == 0 and resume is not None:
            handle, cfg, meta = resume_run(factory, settings.var_dir, resume)
        elif rank == 0:
            cfg = TrainConfig.from_preset(preset, **overrides)
            meta = {"policy": policy, "evaluator": evaluator, "max_docs": max_docs}
        if world > 1:  # every rank trains with rank 0's config
            cfg_dict, meta = _broadcast((cfg.to_dict(), meta) if rank == 0 else None)
            cfg = TrainConfig.from_dict(cfg_dict)
        with console.status("loading data, index and Redis"):
            r = build_retrieval(
                settings, max_docs=meta["max_docs"], progress_factory=index_progress
            )
        scorer = build_scorer(meta["evaluator"], settings, r, split="train")
        eval_req = (
            held_out_request(r, cfg, cfg.eval_split, cfg.eval_queries)
            if cfg.eval_queries and rank == 0
            else None
        )
        with console.status("loading the policy"):
            pol = load_policy_ref(meta["policy"], settings.var_dir, factory, device=device)
            ref = (
                load_policy_ref(cfg.reference, settings.var_dir, factory, device=device).model
                if cfg.reference
                else None
            )
        if rank == 0 and resume is None:
            meta["max_docs"] = r.max_docs  # the slice actually used: a resume rebuilds the same
            handle = open_run(factory, settings.var_dir, cfg, pol, name, meta)
        if world > 1:
            handle = _broadcast(handle if rank == 0 else None)
    except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail(str(exc))
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
        )  # fmt: skip
    if world > 1:
        dist.destroy_process_group()
    if rank != 0:
        return
    if len(handle.evaluations) >= 2:
        print_before_after(handle.evaluations, cfg)
    png, md = report_run(
        factory, handle.run_id, settings.var_dir / "reports" / f"run-{handle.run_id}"
    )
    console.print(
        f"[bold]done:[/] run {handle.run_id} recorded in {redact(settings.sqlalchemy_url)}; "
        f"metrics {handle.metrics_path}; curves {png}; summary {md}"
    )
    if handle.last_checkpoint is not None:
        version, folder = handle.last_checkpoint
        kind = "LoRA adapter" if cfg.params == "lora" else "weights"
        console.print(
            f"final policy: version [bold]{version}[/] ({kind}) in {folder}\n"
            f"  evaluate it: casi eval --policy {version} --split test --queries 100\n"
            f"  serve it:    CASI_API_POLICY={version} casi serve   "
            f"(or POST /v1/policies/{version}/activate)"
        )


def print_before_after(evals: dict[int, dict[str, float]], cfg: Any) -> None:
    """Held-out numbers at the first and the last evaluation of the run, side by side."""
    first, last = min(evals), max(evals)
    a, b = evals[first], evals[last]
    table = Table(
        title=f"held-out {cfg.eval_split} ({cfg.eval_queries} claims): before (step {first}) → after (step {last})"
    )
    for col in ("", "before", "after", "change"):
        table.add_column(col, justify="left" if not col else "right")
    rows = (
        ("query alone nDCG@10", "query_ndcg@10"), ("query + rewrites nDCG@10", "combined_ndcg@10"),
        ("gain over the query, nDCG@10", "gain_ndcg@10"), ("query + rewrites recall@100", "combined_recall@100"),
        ("rewrites alone nDCG@10", "rewrites_ndcg@10"), ("well-formed", "well_formed"),
        ("duplicate rewrites", "duplicate_rate"),
    )  # fmt: skip
    for label, key in rows:
        if key not in a or key not in b:  # an evaluation stored before the metric existed
            continue
        table.add_row(label, f"{a[key]:.4f}", f"{b[key]:.4f}", f"{b[key] - a[key]:+.4f}")
    console.print(table)


def evaluate(
    policy: PolicyOpt = None,
    split: Annotated[str, Opt(help="test | val (validation slice of TRAIN) | train.")] = "test",
    queries: Annotated[
        int, Opt("--queries", min=1, help="The first N judged queries of the split.")
    ] = 100,
    n_actions: Annotated[int, Opt("--n-actions", min=1, max=MAX_PLAYERS)] = 4,
    prompt: Annotated[str, Opt(help="oneshot | short.")] = "oneshot",
    format: FormatOpt = None,
    line_cap: LineCapOpt = None,
    max_new_tokens: MaxNewTokensOpt = None,
    max_docs: MaxDocsOpt = None,
) -> None:
    """Held-out retrieval of a policy: nDCG@10 / recall@100 of the query alone, the rewrites
    alone and query + rewrites (greedy float32 rewrites, constrained format by default); stored
    as an evaluation of that version."""
    settings = get_settings()
    t0 = time.perf_counter()
    try:
        factory = open_database(settings)
        r = build_retrieval(settings, max_docs=max_docs, progress_factory=index_progress)
        given: dict[str, Any] = dict(
            format=format, line_cap=line_cap, max_new_tokens=max_new_tokens
        )
        cfg = TrainConfig(
            n_actions=n_actions, prompt=prompt, **{k: v for k, v in given.items() if v is not None}
        )
        request = held_out_request(r, cfg, split, queries)
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
    except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail(str(exc))
    print_evaluation(
        res.metrics,
        f"{split}: {res.n_queries} queries, policy {pol.version}, index {r.index.version} ({len(r.index)} docs)",
    )
    console.print(
        f"well-formed {res.metrics['well_formed']:.0%}; stored for version {pol.version}; {time.perf_counter() - t0:.0f}s"
    )
