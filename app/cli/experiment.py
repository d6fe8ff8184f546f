"""``casi experiment credit``: does per-action Shapley credit train better than broadcast?"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from app.cli.common import (
    FormatOpt,
    LineCapOpt,
    MaxDocsOpt,
    MaxNewTokensOpt,
    PolicyOpt,
    fail,
    open_database,
    resolve_precisions,
)
from app.cli.train_display import TrainDisplay
from app.progress import console, index_progress
from app.runtime import build_retrieval, build_scorer
from app.settings import Settings, get_settings
from app.training.evaluate import held_out_request
from app.training.experiment import run_experiment
from app.training.experiment_plan import make_plan
from app.training.policy_loader import load_policy_ref
from app.training.splits import split_ids
from evaluator.corpus import load_dataset
from evaluator.retrievers import check_merge, check_retriever
from policy.train_config import TrainConfig

experiment_app = typer.Typer(
    help="Experiments that compare training configurations.", no_args_is_help=True
)
Opt = typer.Option
MAX_EXPERIMENT_ACTIONS = 8  # 256 coalitions per rollout


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


@experiment_app.command("credit")
def credit_experiment(
    modes: Annotated[
        list[str] | None, Opt("--modes", help="Credit modes (repeat or space-separate).")
    ] = None,
    extra: Annotated[
        list[str] | None, typer.Argument(help="More modes after --modes", show_default=False)
    ] = None,
    seeds: Annotated[int, Opt(min=1, help="Seeds per mode (0..N-1).")] = 5,
    steps: Annotated[int, Opt(min=1)] = 20,
    queries: Annotated[int, Opt("--queries", min=1, help="Train queries per step.")] = 8,
    samples: Annotated[int, Opt("--samples", min=2, help="Samples per query.")] = 4,
    n_actions: Annotated[
        int,
        Opt("--n-actions", min=1, max=MAX_EXPERIMENT_ACTIONS, help="m rewrites (2^m coalitions)."),
    ] = 4,
    eval_queries: Annotated[
        str, Opt(help="Held-out claims: N (the first N of the split) or all (the whole split).")
    ] = "100",
    eval_every: Annotated[int, Opt(min=0)] = 10,
    eval_split: Annotated[str, Opt(help="test (report) | val (choose hyperparameters).")] = "test",
    retriever: Annotated[
        str | None, Opt(help="dense (MiniLM + FAISS) | bm25 (default CASI_RETRIEVER).")
    ] = None,
    merge: Annotated[
        str | None,
        Opt(help="Coalition merge: max | rrf | auto (the retriever's: max dense, rrf bm25)."),
    ] = None,
    rrf_k: Annotated[
        float | None, Opt("--rrf-k", min=0.0, help="rrf constant k (default CASI_RRF_K, 60).")
    ] = None,
    anchor: Annotated[
        bool, Opt("--anchor/--no-anchor", help="The query as an anchor player.")
    ] = True,
    preset: Annotated[str, Opt()] = "casi",
    lr: Annotated[float, Opt(min=0.0)] = 1e-5,
    precision: Annotated[
        str,
        Opt(
            help="Sampler: auto (bf16 only where native) | float32 | bfloat16; held-out is float32."
        ),
    ] = "auto",
    train_precision: Annotated[
        str, Opt(help="Training forward: auto | float32 | bfloat16.")
    ] = "auto",
    prompt: Annotated[str, Opt()] = "short",
    format: FormatOpt = None,
    line_cap: LineCapOpt = None,
    max_new_tokens: MaxNewTokensOpt = None,
    evaluator: Annotated[str, Opt()] = "replay",
    policy: PolicyOpt = None,
    max_docs: MaxDocsOpt = None,
    name: Annotated[
        str, Opt(help="Experiment name: rerun the same command to resume it.")
    ] = "credit",
) -> None:
    """Train every credit mode × seed from the same policy with the same compute, evaluate on
    the same held-out claims (greedy float32, the `casi eval` path), write table.md (means,
    per-seed, paired bootstrap CIs / p-values), ndcg.png and results.json under
    var/experiments/<name>/ (resumable)."""
    settings = get_settings()
    chosen = list(modes or []) + list(extra or []) or [
        "broadcast",
        "singleton",
        "leave_one_out",
        "shapley",
    ]
    folder = settings.var_dir / "experiments" / name
    try:
        env_settings, env = environment_settings(settings, retriever, merge, rrf_k)
        sampler_p, train_p = resolve_precisions(
            precision, train_precision, settings
        )  # auto resolved
        factory = open_database(settings)
        given = dict(format=format, line_cap=line_cap, max_new_tokens=max_new_tokens)
        cfg = TrainConfig.from_preset(
            preset, steps=steps, queries=queries, samples=samples, n_actions=n_actions, lr=lr,
            eval_every=eval_every, eval_queries=count_eval_queries(settings, eval_split, eval_queries),
            eval_split=eval_split, precision=sampler_p, train_precision=train_p,
            prompt=prompt, anchor_query=anchor, state_every=max(1, eval_every or steps),
            list_k=settings.list_k, **{k: v for k, v in given.items() if v is not None},
        )  # fmt: skip
        for mode in chosen:
            TrainConfig.from_preset(preset, credit=mode)  # a bad mode fails now, not after hours
        plan = make_plan(
            folder,
            name,
            chosen,
            list(range(seeds)),
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
        scorer = build_scorer(plan.meta["evaluator"], env_settings, r, split="train")
        stored = TrainConfig.from_dict(plan.config)
        request = held_out_request(r, stored, stored.eval_split, stored.eval_queries)
        pol = load_policy_ref(
            plan.meta["policy"], settings.var_dir, factory, device=settings.resolved_device()
        )
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
        f"experiment [bold]{name}[/]: {', '.join(chosen)} × {seeds} seeds; retriever {plan.meta['retriever']}, "
        f"merge {plan.meta['merge']}; {cfg.steps} steps × {cfg.queries} queries × {cfg.samples} samples × "
        f"m={cfg.n_actions}; held-out {cfg.eval_queries} {cfg.eval_split} claims"
    )
    try:
        results = run_experiment(
            factory, settings.var_dir, folder, plan, build, on_cell=on_cell,
            on_step=lambda r: displays[-1].step(r),
            on_eval=lambda s, r: displays[-1].evaluation(s, r) if displays else None,
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
