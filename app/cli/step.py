"""``casi step``: one real training step, printed per query, recorded in the database."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from app.cli.common import FormatOpt, LineCapOpt, MaxNewTokensOpt, PolicyOpt, fail
from app.db.connect import connect
from app.progress import console, index_progress
from app.runtime import build_retrieval, build_scorer, preflight
from app.settings import get_settings
from app.training.policy_loader import load_policy_ref
from app.training.step import run_step
from evaluator.corpus import DatasetError
from evaluator.limits import MAX_PLAYERS
from policy.train_config import TrainConfig


def _hits(rows: list[int], relevant: set[int]) -> str:
    return "".join("●" if r in relevant else ("·" if r >= 0 else " ") for r in rows)


def print_step(report, dataset) -> None:  # type: ignore[no-untyped-def]
    res = report.result
    g = res.base.shape[1]
    for b, (qid, text) in enumerate(report.queries):
        relevant = set(dataset.qrels_rows("train").get(qid, {}))
        table = Table(title=f"query {qid}: {text[:90]}", show_lines=True)
        for col, just in (
            ("s", "right"),
            ("a", "right"),
            ("action", "left"),
            ("hits@10", "left"),
            ("φ", "right"),
            ("single", "right"),
            ("LOO", "right"),
            ("x", "right"),
            ("A+λx", "right"),
        ):
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        for s in range(g):
            i = b * g + s
            rec = res.credit.record(i)
            base = float(res.base[b, s])
            r = res.rollouts[i]
            if not rec["actions"]:
                table.add_row(
                    str(s),
                    "-",
                    f"[dim]({r.parsed.status}: no action)[/]",
                    "",
                    "",
                    "",
                    "",
                    "",
                    f"{base:+.3f}",
                )
            for j, action in enumerate(rec["actions"]):
                x = float(res.shaped[b, s, j])
                head = (
                    f"{s}\nv(N)={rec['value_full']:.3f}\nA={base:+.3f}\n{r.parsed.status}"
                    if j == 0
                    else ""
                )
                table.add_row(
                    head,
                    str(j + 1),
                    action[:48] or "(empty)",
                    _hits(rec["action_rows"][j], relevant),
                    f"{rec['credits'][j]:+.3f}",
                    f"{rec['baselines']['singleton'][j]:+.3f}",
                    f"{rec['baselines']['leave_one_out'][j]:+.3f}",
                    f"{x:+.2f}",
                    f"{base + report.lam * x:+.3f}",
                )
        console.print(table)


def print_metrics(report) -> None:  # type: ignore[no-untyped-def]
    m = report.result.metrics
    tail = [
        "grad_norm",
        "step_applied",
        "reward_mean",
        "format_ok_fraction",
        "efficiency_residual_max",
        "cache_hits",
        "cache_misses",
        "cache_hit_rate_total",
    ]
    keys = [
        k
        for k in m
        if k not in tail and any(t in k for t in ("frac", "ess", "mismatch", "kl", "clip", "mask"))
    ]
    table = Table(title="loss stack metrics (token-weighted over micro-batches)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k in ["loss", *sorted(keys), *tail]:
        if k in m:
            table.add_row(k, f"{m[k]:.4g}")
    console.print(table)


def step(
    queries: Annotated[int, typer.Option("--queries", min=1, help="TRAIN-split queries (B).")] = 4,
    samples: Annotated[int, typer.Option("--samples", min=2, help="Samples per query (G).")] = 4,
    n_actions: Annotated[
        int,
        typer.Option("--n-actions", min=1, max=MAX_PLAYERS, help="Rewrites per generation (m)."),
    ] = 4,
    preset: Annotated[
        str, typer.Option("--preset", help="Loss-stack preset (configs/*.toml) or a path.")
    ] = "casi",
    evaluator: Annotated[
        str, typer.Option("--evaluator", help="replay | surrogate | cosine")
    ] = "replay",
    policy: PolicyOpt = None,
    dataset: Annotated[str | None, typer.Option("--dataset")] = None,
    max_docs: Annotated[
        int | None, typer.Option("--max-docs", min=1, help="Index slice (see README).")
    ] = None,
    format: FormatOpt = None,
    line_cap: LineCapOpt = None,
    max_new_tokens: MaxNewTokensOpt = None,
    temperature: Annotated[
        float, typer.Option(min=0.05, help="Sampler temperature (μ and π use it).")
    ] = 0.7,
    precision: Annotated[
        str, typer.Option(help="Sampler precision: float32 | bfloat16 | int8")
    ] = "float32",
    lr: Annotated[float, typer.Option(min=0.0)] = 1e-5,
    seed: int = 0,
) -> None:
    """One step end to end: sample → cached actions → credit → shaping → loss stack → update."""
    settings = get_settings()
    t0 = time.perf_counter()
    try:
        TrainConfig.from_preset(preset)  # a bad preset fails before anything heavy loads
        preflight(settings, database=True)  # so does a bad database or var dir
        with console.status("loading data, index and Redis"):
            r = build_retrieval(
                settings,
                dataset_path=Path(dataset) if dataset else None,
                max_docs=max_docs,
                progress_factory=index_progress,
            )
        console.print(
            f"index {r.index.version}: {len(r.index)} docs ({'built' if r.built_now else 'reused'})"
        )
        scorer = build_scorer(evaluator, settings, r, split="train")
        with console.status("loading the policy (first time: converting the GGUF)"):
            with connect(settings) as db:
                loaded = load_policy_ref(
                    policy, settings.var_dir, db.factory, device=settings.resolved_device()
                )
            model, tok = loaded.model, loaded.tokenizer
        fmt: dict[str, Any] = {
            k: v for k, v in (("format", format), ("line_cap", line_cap)) if v is not None
        }
        with console.status(f"sampling {queries}×{samples} generations, crediting, updating"):
            report = run_step(
                settings,
                r,
                scorer,
                model,
                tok,
                n_queries=queries,
                n_samples=samples,
                n_actions=n_actions,
                preset=preset,
                lr=lr,
                seed=seed,
                max_new_tokens=max_new_tokens,
                **fmt,
                precision=precision,
                temperature=temperature,
                model_path=loaded.path,
            )
    except (DatasetError, ValueError, FileNotFoundError, LookupError) as exc:
        fail(str(exc))
        return
    print_step(report, r.dataset)
    print_metrics(report)
    cache = report.result.credit.cache
    console.print(
        f"cache: {cache['status']}; this step {cache['hits']} hits / {cache['misses']} misses; "
        f"policy {report.version_before} → {report.version_after}; {time.perf_counter() - t0:.0f}s"
    )
    console.print(
        f"[bold]records:[/] run {report.run_id}, {report.n_records} credit records in {report.database}"
    )
