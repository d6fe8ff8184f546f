"""``casi rewrite`` (serve rewrites from a policy) and ``casi policy warmstart`` (format SFT)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from app.progress import console, progress_bar
from app.settings import get_settings

policy_app = typer.Typer(
    help="The rewrite policy: warm start and checkpoints.", no_args_is_help=True
)
PolicyOpt = Annotated[
    str | None,
    typer.Option("--policy", help="Local HF model folder (default SmolLM2-135M-Instruct)."),
]


def rewrite(
    query: Annotated[str, typer.Option("--query", help="The user query to rewrite.")],
    n_actions: Annotated[int, typer.Option("--n-actions", min=1, max=12)] = 4,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Independent generations.")] = 1,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.7,
    max_new_tokens: Annotated[int, typer.Option(min=8)] = 96,
    seed: int = 0,
    policy: PolicyOpt = None,
) -> None:
    """Sample m rewrites of a query in ONE generation and print them with their token spans."""
    from app.cli.common import fail
    from policy.model import load_policy
    from policy.rollout import sample_rollouts
    from policy.sampler import SamplerConfig

    if not query.strip():
        fail("--query must not be empty")
    settings = get_settings()
    try:
        with console.status("loading the policy (the first time converts the GGUF, ~40 s)"):
            model, tok = load_policy(policy, settings.var_dir, progress=False)
    except (FileNotFoundError, ValueError, OSError) as exc:
        fail(str(exc))
        return
    t0 = time.perf_counter()
    cfg = SamplerConfig(
        temperature=max(temperature, 1e-3),
        max_new_tokens=max_new_tokens,
        seed=seed,
        do_sample=temperature > 0,
    )
    rollouts = sample_rollouts(model, tok, [query], samples, n_actions, cfg)
    for r in rollouts:
        table = Table(
            title=f"sample {r.sample_index}: {r.parsed.status}, policy {r.policy_version}"
        )
        table.add_column("#", justify="right")
        table.add_column("rewrite")
        table.add_column("tokens", justify="right")
        for j, a in enumerate(r.parsed.actions):
            dup = f" (= #{a.duplicate_of + 1})" if a.duplicate_of is not None else ""
            table.add_row(str(j + 1), a.text + dup, f"[{a.token_start}, {a.token_end})")
        console.print(table)
    console.print(
        f"{sum(len(r.response_ids) for r in rollouts)} tokens in {time.perf_counter() - t0:.1f}s"
    )


@policy_app.command("warmstart")
def warmstart_cmd(
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps.")] = 60,
    batch_size: Annotated[int, typer.Option(min=1)] = 8,
    lr: Annotated[float, typer.Option(min=0.0)] = 5e-5,
    n_actions: Annotated[int, typer.Option("--n-actions", min=1, max=12)] = 4,
    queries: Annotated[
        int | None, typer.Option(min=1, help="Use the first N train queries.")
    ] = None,
    policy: PolicyOpt = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Checkpoint folder (default var/models/warmstart-<version>)."),
    ] = None,
    seed: int = 0,
) -> None:
    """SFT on the TRAIN split teaching the numbered-rewrite format; checkpoint registered in the DB."""
    from app.db import repositories as repo
    from app.db import session_scope
    from app.db.session import make_engine, make_session_factory, upgrade_to_head
    from evaluator.corpus import load_dataset
    from policy.model import load_policy, policy_version, save_checkpoint
    from policy.warmstart import make_warmstart_examples, warmstart

    settings = get_settings()
    ds = load_dataset(settings.dataset, splits=("train",))
    title = {d.doc_id: d.title for d in ds.documents}
    qids = ds.split_query_ids("train")[:queries]
    items = [(ds.queries[q], [title[d] for d in ds.qrels["train"][q]]) for q in qids]
    examples = make_warmstart_examples(items, n_actions, seed=seed)
    with console.status("loading the policy"):
        model, tok = load_policy(policy, settings.var_dir, progress=False)
    parent = policy_version(model)
    with progress_bar("Warm start (SFT steps)", steps) as advance:
        metrics = warmstart(
            model,
            tok,
            examples,
            epochs=10**6,
            max_steps=steps,
            lr=lr,
            batch_size=batch_size,
            seed=seed,
            progress=lambda *_: advance(1),
        )
    version = policy_version(model)
    folder = save_checkpoint(
        model, tok, out or settings.var_dir / "models" / f"warmstart-{version}"
    )
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.sqlalchemy_url)
    engine = make_engine(settings.sqlalchemy_url)
    with session_scope(make_session_factory(engine)) as session:
        base = repo.get_policy_version_by_version(session, parent) or repo.add_policy_version(
            session,
            version=parent,
            name="base",
            base_model=policy or "SmolLM2-135M-Instruct",
            path=policy or "default",
            kind="base",
        )
        repo.add_policy_version(
            session,
            version=version,
            name="warmstart",
            base_model=base.base_model,
            path=str(folder),
            kind="warmstart",
            step=steps,
            parent_id=base.id,
            meta={
                "losses": [float(x) for x in metrics.losses],
                "examples": len(examples),
                "lr": lr,
            },
        )
    engine.dispose()
    console.print(
        f"loss {metrics.losses[0]:.3f} → {metrics.losses[-1]:.3f}; checkpoint {folder} "
        f"(version {version}, registered in {settings.sqlalchemy_url})"
    )
    console.print(f"use it: casi step --policy {folder}")
