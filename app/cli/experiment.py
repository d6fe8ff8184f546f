"""``casi experiment credit``: does per-action Shapley credit train better than broadcast?"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from app.cli.common import MaxDocsOpt, PolicyOpt, fail
from app.progress import console, index_progress
from app.settings import get_settings

experiment_app = typer.Typer(
    help="Experiments that compare training configurations.", no_args_is_help=True
)
Opt = typer.Option


@experiment_app.command("credit")
def credit_experiment(
    modes: Annotated[
        list[str] | None, Opt("--modes", help="Credit modes (repeat or space-separate).")
    ] = None,
    extra: Annotated[
        list[str] | None, typer.Argument(help="More modes after --modes", show_default=False)
    ] = None,
    seeds: Annotated[int, Opt(min=1, help="Seeds per mode (0..N-1).")] = 3,
    steps: Annotated[int, Opt(min=1)] = 20,
    queries: Annotated[int, Opt("--queries", min=1)] = 8,
    samples: Annotated[int, Opt("--samples", min=2)] = 4,
    n_actions: Annotated[int, Opt("--n-actions", min=1, max=12)] = 4,
    eval_queries: Annotated[
        int, Opt(min=1, help="Held-out claims (the first N of the split).")
    ] = 100,
    eval_every: Annotated[int, Opt(min=0)] = 10,
    eval_split: Annotated[str, Opt(help="test (report) | val (choose hyperparameters).")] = "test",
    preset: Annotated[str, Opt()] = "casi",
    lr: Annotated[float, Opt(min=0.0)] = 1e-5,
    precision: Annotated[str, Opt(help="Sampler precision.")] = "bfloat16",
    train_precision: Annotated[str, Opt()] = "bfloat16",
    prompt: Annotated[str, Opt()] = "short",
    max_new_tokens: Annotated[int, Opt(min=8)] = 64,
    evaluator: Annotated[str, Opt()] = "replay",
    policy: PolicyOpt = None,
    max_docs: MaxDocsOpt = None,
    name: Annotated[
        str, Opt(help="Experiment name: rerun the same command to resume it.")
    ] = "credit",
) -> None:
    """Train every credit mode × seed from the same policy, evaluate on the same held-out claims,
    write table.md, ndcg.png and results.json under var/experiments/<name>/ (resumable)."""
    from app.cli.train import build_eval_request, open_database
    from app.cli.train_display import TrainDisplay
    from app.runtime import build_retrieval, build_scorer
    from app.services.experiment import make_plan, run_experiment
    from app.services.policy_loader import load_policy_ref
    from policy.train_config import TrainConfig

    settings = get_settings()
    chosen = list(modes or []) + list(extra or []) or [
        "broadcast",
        "singleton",
        "leave_one_out",
        "shapley",
    ]
    folder = settings.var_dir / "experiments" / name
    try:
        factory = open_database(settings)
        cfg = TrainConfig.from_preset(
            preset, steps=steps, queries=queries, samples=samples, n_actions=n_actions, lr=lr,
            eval_every=eval_every, eval_queries=eval_queries, eval_split=eval_split, precision=precision,
            train_precision=train_precision, prompt=prompt, max_new_tokens=max_new_tokens,
            state_every=max(1, eval_every or steps), list_k=settings.list_k,
        )  # fmt: skip
        for mode in chosen:
            TrainConfig.from_preset(preset, credit=mode)  # a bad mode fails now, not after hours
        plan = make_plan(
            folder,
            name,
            chosen,
            list(range(seeds)),
            cfg,
            {"policy": policy, "evaluator": evaluator, "max_docs": max_docs},
        )
    except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail(str(exc))

    def build() -> tuple[Any, ...]:
        r = build_retrieval(
            settings, max_docs=plan.meta["max_docs"], progress_factory=index_progress
        )
        plan.meta["max_docs"] = r.max_docs
        scorer = build_scorer(plan.meta["evaluator"], settings, r, split="train")
        stored = TrainConfig.from_dict(plan.config)
        request = build_eval_request(r, stored, stored.eval_split, stored.eval_queries)
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

    results = run_experiment(
        factory, settings.var_dir, folder, plan, build, on_cell=on_cell,
        on_step=lambda r: displays[-1].step(r), on_eval=lambda s, r: displays[-1].evaluation(s, r),
    )  # fmt: skip
    for d in displays:
        d.__exit__(None, None, None)
    console.print((folder / "table.md").read_text())
    console.print(
        f"results: {folder / 'results.json'}, plot: {folder / 'ndcg.png'} ({len(results['curves'])} runs)"
    )
