"""``casi estimate``: how long a job of a given shape takes on this machine, from a probe.

It loads the policy, measures decode, prefill and training speed at the job's own shapes for
a few seconds (`policy.probe.measure_speed`) and prints the expected duration of each part
(`policy.probe.estimate_seconds`): a warm start, training steps, held-out evaluations.
`make demo` runs it first, so a user on a slower machine knows what to expect.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import PolicyOpt, fail, open_database
from app.progress import clock, console
from app.runtime import configure_threads
from app.settings import get_settings
from app.training.policy_loader import load_policy_ref
from policy.precision import resolve_precision
from policy.probe import PROMPT_SHAPES, estimate_seconds, head_share, measure_speed, shape_for

LOAD_S_PER_COMMAND = 15.0
"""Seconds a `casi` command spends starting: imports, loading the policy, the data, Redis
(measured 10-20 s on 2 cores); added once per command of the job."""


def estimate(
    steps: Annotated[int, typer.Option(min=0, help="Training steps.")] = 0,
    queries: Annotated[int, typer.Option(min=1, help="Queries per step (B).")] = 8,
    samples: Annotated[int, typer.Option(min=1, help="Samples per query (G).")] = 4,
    eval_queries: Annotated[int, typer.Option(min=0, help="Claims per held-out evaluation.")] = 0,
    evaluations: Annotated[
        int, typer.Option(min=0, help="Held-out evaluations (a run: before and after = 2).")
    ] = 2,
    warmstart_steps: Annotated[int, typer.Option(min=0, help="Warm-start SFT steps.")] = 0,
    warmstart_top_layers: Annotated[
        int | None, typer.Option(min=1, help="The warm start trains only the top N layers.")
    ] = None,
    top_layers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="The training run trains only the top N layers (--params top --top-layers N).",
        ),
    ] = None,
    commands: Annotated[
        int, typer.Option(min=0, help="`casi` commands in the job (their start-up).")
    ] = 0,
    precision: Annotated[
        str, typer.Option(help="float32 | bfloat16 | auto: the precision the job runs in.")
    ] = "auto",
    prompt: Annotated[
        str,
        typer.Option(
            help=f"The job's prompt style ({' | '.join(PROMPT_SHAPES)}): its prompt and response "
            "lengths, measured (the feedback prompt is longer)."
        ),
    ] = "short",
    policy: PolicyOpt = None,
) -> None:
    """Measure this machine on the policy (a few seconds) and print how long a job of this
    shape takes: warm start, training steps, evaluations."""
    settings = get_settings()
    configure_threads(settings)
    device = settings.resolved_device()  # the probe runs there; `auto` is resolved for it
    precision = resolve_precision(precision, device)
    if precision not in ("float32", "bfloat16"):
        fail(f"--precision must be float32, bfloat16 or auto, got {precision!r}")
    try:
        shape_for(prompt)  # an unknown style is named before the policy loads
    except ValueError as exc:
        fail(str(exc))
    try:
        # a registered version (or `warmstart`) is looked up in the database; a folder needs none
        named = policy is not None and not Path(policy).is_dir()
        factory = open_database(settings) if named else None
        with console.status("loading the policy"):
            loaded = load_policy_ref(policy, settings.var_dir, factory, device=device)
    except (FileNotFoundError, ValueError, LookupError, OSError) as exc:
        fail(str(exc))
    model, tok = loaded.model, loaded.tokenizer
    layers = len(getattr(getattr(model, "model", None), "layers", [])) or 1
    for flag, asked in (
        ("--warmstart-top-layers", warmstart_top_layers),
        ("--top-layers", top_layers),
    ):
        if asked is not None and asked > layers:  # a share above 1 would inflate the estimate
            fail(
                f"{flag} must be in 1..{layers} for this model, got {asked} — it has {layers} decoder layers"
            )
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0 = time.perf_counter()
    with console.status("measuring decode, prefill and training speed"):
        speed = measure_speed(model, int(pad), rows=queries * samples, precision=precision)
    probe_s = time.perf_counter() - t0
    shape = shape_for(
        prompt,
        steps=steps, queries=queries, samples=samples, eval_claims=eval_queries,
        evaluations=evaluations if eval_queries else 0, warmstart_steps=warmstart_steps,
        warmstart_layers_share=(warmstart_top_layers or layers) / layers,
        train_layers_share=(top_layers or layers) / layers,
        head_share=head_share(model) if top_layers else 0.0,
    )  # fmt: skip
    parts = estimate_seconds(speed, shape)
    parts["start-up of each command"] = commands * LOAD_S_PER_COMMAND
    table = Table(
        title=f"expected duration on this machine ({settings.threads} threads, {precision})"
    )
    table.add_column("part")
    table.add_column("expected", justify="right")
    for name, seconds in parts.items():
        if seconds:
            table.add_row(name, clock(seconds))
    total = sum(parts.values())
    table.add_row("[bold]total[/]", f"[bold]{clock(total)}[/]")
    console.print(table)
    console.print(
        f"probe ({probe_s:.0f} s, policy {loaded.version}, {prompt} prompt): decode "
        f"{speed.decode_row_tokens_s:.0f} row-tokens/s at {speed.rows} rows, prefill {speed.prefill_tokens_s:.0f} tokens/s, "
        f"forward + backward {speed.train_tokens_s:.0f} tokens/s; indexing and downloads not "
        "included"
    )
