"""``casi rewrite`` (serve rewrites from a policy), ``casi policy warmstart`` (format SFT),
``casi policy merge`` (LoRA → full weights) and ``casi policy export`` / ``import`` (one version
carried to another machine as one checked archive)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from app.cli.common import LineCapOpt, MaxNewTokensOpt, fail, open_database
from app.cli.common import PolicyOpt as CommonPolicyOpt
from app.db.connect import connect
from app.errors import CasiError
from app.limits import check_text
from app.progress import console, index_progress, progress_bar
from app.runtime import build_retrieval, configure_threads, preflight
from app.settings import Settings, get_settings
from app.training import portable
from app.training import warmstart as recipe
from app.training.evaluate import machine_info
from app.training.policy_loader import load_policy_ref
from app.training.policy_prompt import PolicyPrompt, read_prompt
from evaluator.corpus import DatasetError
from evaluator.limits import MAX_FEEDBACK_WORDS, MAX_PLAYERS
from evaluator.locks import build_lock
from evaluator.text import degenerate
from policy.constrain import DEFAULT_LINE_CAP, free_response_cap
from policy.model import policy_version
from policy.precision import resolve_precision
from policy.prompts import DEFAULT_FEEDBACK_WORDS, PROMPT_STYLES
from policy.rollout import sample_rollouts
from policy.sampler import SamplerConfig, serving_guard
from policy.warmstart import DEFAULT_WORDS, PSEUDO_SOURCES, warmstart

policy_app = typer.Typer(
    help="The rewrite policy: warm start and checkpoints.", no_args_is_help=True
)


def rewrite(
    query: Annotated[str, typer.Option("--query", help="The user query to rewrite.")],
    n_actions: Annotated[int, typer.Option("--n-actions", min=1, max=MAX_PLAYERS)] = 4,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Independent generations.")] = 1,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.7,
    format: Annotated[
        str, typer.Option("--format", help="constrained (exactly m lines) | free.")
    ] = "constrained",
    line_cap: LineCapOpt = None,
    max_new_tokens: MaxNewTokensOpt = None,
    seed: int = 0,
    policy: CommonPolicyOpt = None,
    prompt: Annotated[
        str | None,
        typer.Option(
            help="Prompt style: oneshot | short | feedback (the query's first retrieval's words, "
            "from the game's index); default: the one the policy was trained with."
        ),
    ] = None,
) -> None:
    """Sample m rewrites of a query in ONE generation and print them with their token spans."""
    query = check_text(query, "--query")  # before the policy loads
    settings = get_settings()
    configure_threads(settings)
    line_cap = line_cap or DEFAULT_LINE_CAP
    try:
        if format not in ("constrained", "free"):
            raise ValueError(f"--format must be constrained or free, got {format!r}")
        if format == "constrained" and max_new_tokens is not None:
            raise ValueError("--max-new-tokens applies to --format free only (set --line-cap)")
        with console.status("loading the policy (the first time converts the GGUF, ~40 s)"):
            loaded = load_policy_ref(
                policy, settings.var_dir, _factory_or_none(settings),
                device=settings.resolved_device(),
            )  # fmt: skip
        model, tok = loaded.model, loaded.tokenizer
        shape = read_prompt(loaded.path)  # as the policy was trained, unless --prompt says
        if prompt is not None:
            shape = PolicyPrompt(prompt, shape.feedback_words)
        contexts = None
        if shape.style == "feedback":  # what the query's own list found: the game's index
            game = build_retrieval(settings, progress_factory=index_progress)
            contexts = game.feedback().contexts([query], shape.feedback_words, n_actions)
    except (FileNotFoundError, ValueError, LookupError, OSError) as exc:
        fail(str(exc))
        return
    t0 = time.perf_counter()
    cfg = SamplerConfig(
        temperature=max(temperature, 1e-3),
        max_new_tokens=max_new_tokens or free_response_cap(n_actions, line_cap),
        seed=seed,
        do_sample=temperature > 0,
    )
    rollouts = sample_rollouts(
        model, tok, [query], samples, n_actions, cfg, loaded.version, format=format,
        line_cap=line_cap, prompt_style=shape.style, contexts=contexts,
        refuse_degenerate=serving_guard(cfg, format == "constrained"),  # as serving decodes
    )  # fmt: skip
    if contexts is not None:
        console.print(f"feedback context: {contexts[0]}")
    for r in rollouts:
        table = Table(
            title=f"sample {r.sample_index}: {r.parsed.status}, policy {r.policy_version}"
        )
        table.add_column("#", justify="right")
        table.add_column("rewrite")
        table.add_column("tokens", justify="right")
        for j, a in enumerate(r.parsed.actions):
            dup = f" (= #{a.duplicate_of + 1})" if a.duplicate_of is not None else ""
            dup += " (degenerate: served as empty)" if degenerate(a.text) else ""
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
    n_actions: Annotated[int, typer.Option("--n-actions", min=1, max=MAX_PLAYERS)] = 4,
    queries: Annotated[
        int | None, typer.Option(min=1, help="Use the first N train queries.")
    ] = None,
    policy: CommonPolicyOpt = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Checkpoint folder (default var/models/warmstart-<version>): a new or empty "
            "folder, or one holding this same version (reused); anything else is refused."
        ),
    ] = None,
    seed: int = 0,
    prompt: Annotated[
        str,
        typer.Option(
            help="Prompt style to teach: oneshot (with the worked example) | short | feedback "
            "(the query and its first retrieval's ranked words; with --source prf)."
        ),
    ] = "oneshot",
    train_precision: Annotated[
        str,
        typer.Option(
            help="float32 | bfloat16 (autocast; ~3x faster on AMX CPUs, 65x SLOWER where bf16 is "
            "emulated) | auto (bf16 only where native)."
        ),
    ] = "float32",
    top_layers: Annotated[
        int | None,
        typer.Option(
            "--top-layers",
            min=1,
            help="Train only the top N decoder layers and the final norm (cheaper backward); "
            "default: every weight.",
        ),
    ] = None,
    source: Annotated[
        str,
        typer.Option(
            help="Pseudo-rewrites from: titles (the query, its keywords and the relevant "
            "documents' titles) | openings (the opening content words of distinct relevant "
            "documents, never the query) | keywords (their most frequent content words) | prf "
            "(the teacher: keyword expansion's rewrites, read from the feedback context; with "
            "--prompt feedback; needs the game's index: casi index build)."
        ),
    ] = "titles",
    feedback_words: Annotated[
        int,
        typer.Option(
            "--feedback-words",
            min=1,
            max=MAX_FEEDBACK_WORDS,
            help="--prompt feedback: ranked feedback words the prompt shows.",
        ),
    ] = DEFAULT_FEEDBACK_WORDS,
    words: Annotated[
        int, typer.Option(min=1, max=64, help="Words per openings / keywords pseudo-rewrite.")
    ] = DEFAULT_WORDS,
) -> None:
    """SFT on the TRAIN split (minus the validation slice) teaching the numbered-rewrite format;
    checkpoint registered in the DB.

    The database and var dir are checked first; re-running the same warm start reuses its
    checkpoint and registration (idempotent); concurrent runs write the output one at a time."""
    settings = get_settings()
    preflight(settings, database=True)  # fail in seconds, not after the training
    configure_threads(settings)
    device = settings.resolved_device()  # the policy trains there; `auto` is resolved for it
    train_precision = resolve_precision(train_precision, device)
    if prompt not in PROMPT_STYLES or train_precision not in ("float32", "bfloat16"):
        fail(
            f"--prompt must be one of {', '.join(PROMPT_STYLES)}, --train-precision float32, "
            "bfloat16 or auto"
        )
    if source not in PSEUDO_SOURCES:
        fail(f"--source must be one of {', '.join(PSEUDO_SOURCES)}, got {source!r}")
    if (source == "prf") != (prompt == "feedback"):
        fail(
            "--source prf and --prompt feedback go together: the teacher's rewrites are read "
            "from the feedback context, which only the feedback prompt shows"
        )
    try:  # a folder of the user's is never replaced: refused before the training
        if out is not None:
            recipe.check_out(out)
    except CasiError as exc:
        fail(str(exc))
    try:  # prf: the teacher reads each query's first retrieval, the game's index
        examples = recipe.start_examples(
            settings, n_actions, queries, seed, source, words, feedback_words, index_progress
        )
    except DatasetError:  # the boundary names the file, the line and the fix
        raise
    except (FileNotFoundError, ValueError, OSError) as exc:
        fail(str(exc))
    if source == "prf" and not examples:
        fail("no TRAIN query's top documents give --n-actions keyword rewrites")
    with console.status("loading the policy"):
        try:
            with connect(settings) as db:
                loaded = load_policy_ref(policy, settings.var_dir, db.factory, device=device)
        except (FileNotFoundError, ValueError, LookupError, OSError) as exc:
            fail(str(exc))
    model, tok, parent = loaded.model, loaded.tokenizer, loaded.version
    base_path = loaded.path  # the folder a version names, or default:<name> (loadable)
    key = recipe.start_recipe(
        parent, examples, steps, batch_size, lr, seed, prompt, train_precision, source, words,
        top_layers, feedback_words,
    )  # fmt: skip
    # Identical runs at once: the second waits for the first, then reuses what it wrote.
    guard = (
        build_lock(recipe.recipe_index(settings.var_dir) / key, f"the warm start {key}")
        if out is None
        else contextlib.nullcontext()
    )
    with guard:
        done = recipe.cached_warmstart(settings.var_dir, key) if out is None else None
        if done is not None:  # the same inputs were trained before: reuse, do not train again
            carried = [h for h in recipe.recipe_starts(settings.var_dir, key) if h.folder == done]
            origin = (
                f"; imported, made on {carried[0].made_on or 'an unrecorded CPU'}"
                if carried and carried[0].imported
                else ""
            )
            console.print(
                f"warm start reused: {done} (same policy, data and settings; recipe {key}{origin})"
            )
            console.print(f"use it: casi train --policy {done}")
            return
        with progress_bar("Warm start (SFT steps)", steps) as advance:
            metrics = warmstart(
                model, tok, examples, epochs=10**6, max_steps=steps, lr=lr,
                batch_size=batch_size, seed=seed, progress=lambda _step, _total, loss: advance(1, f"loss {loss:.3f}"),
                prompt_style=prompt, train_precision=train_precision, top_layers=top_layers,
            )  # fmt: skip
        version = policy_version(model)
        target = out or settings.var_dir / "models" / f"warmstart-{version}"
        with build_lock(target, f"the warm-start output {target}"):
            try:  # --out holding anything but this version: refused, nothing replaced
                folder, reused = recipe.save_once(
                    model, tok, target, version, keep_other=out is not None,
                    prompt=PolicyPrompt(prompt, feedback_words),
                )  # fmt: skip
            except CasiError as exc:
                fail(str(exc))
            meta = {"losses": [float(x) for x in metrics.losses], "examples": len(examples),
                    "lr": lr, "prompt": prompt, "train_precision": train_precision,
                    "top_layers": top_layers, "source": source, "words": words,
                    "recipe": key, "made_on": machine_info()["cpu_family"],
                    "truncated": metrics.truncated,
                    **({"feedback_words": feedback_words} if source == "prf" else {})}  # fmt: skip
            with connect(settings) as db:
                new = recipe.register_warmstart(
                    db.factory, parent=parent, version=version, folder=folder, policy=base_path,
                    meta=meta, steps=steps,
                )  # fmt: skip
        if out is None:
            recipe.remember_warmstart(settings.var_dir, key, folder)
    shown = make_url(settings.sqlalchemy_url).render_as_string(hide_password=True)
    console.print(
        f"loss {metrics.losses[0]:.3f} → {metrics.losses[-1]:.3f}; checkpoint {folder} "
        f"({'reused' if reused else 'saved'}, version {version}, "
        f"{'registered in' if new else 'already registered in'} {shown})"
    )
    if metrics.truncated:
        console.print(
            f"[yellow]warning:[/] {metrics.truncated} of {len(examples)} examples were longer than "
            "the warm start's 320 tokens and were cut, losing their end of turn: --prompt short, "
            "fewer --words or fewer --n-actions keep every example whole"
        )
    console.print(f"use it: casi train --policy {folder}")


def _factory_or_none(settings: Settings) -> sessionmaker[Session] | None:
    """A session factory when the database is reachable (to resolve versions), else None."""
    try:
        db = connect(settings)
        with db.engine.connect():
            pass
    except Exception:  # no database: folders and the default still work
        return None
    return db.factory


@policy_app.command("merge")
def merge_cmd(
    policy: Annotated[str, typer.Argument(help="A LoRA checkpoint: version, prefix or folder.")],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Folder of the merged weights (default beside): a new or empty folder, or one "
            "holding this same version (reused); anything else is refused.",
        ),
    ] = None,
) -> None:
    """Merge a LoRA adapter checkpoint into full weights, saved and registered as a version."""
    settings = get_settings()
    configure_threads(settings)
    try:
        factory = open_database(settings)
        with console.status("loading the base and merging the adapter"):
            version, target = recipe.merge_lora(factory, settings.var_dir, policy, out)
    except (CasiError, ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail(str(exc))
        return
    console.print(f"merged: version [bold]{version}[/] (full weights) in {target}")


@policy_app.command("export")
def export_cmd(
    policy: Annotated[
        str, typer.Argument(help="A version (hash or unique prefix), `warmstart` or a folder.")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="The archive to write: .tar, or .tar.gz / .tgz.")
    ],
) -> None:
    """Pack one policy version into one archive (weights, tokenizer, manifest, registration and
    the warm-start recipes that name it), to carry it to another machine: `casi policy import`.

    A warm-start recipe makes the same weights bit for bit only on one CPU microarchitecture, so
    a protocol seed begun on one machine is finished on another CPU from its exported start."""
    settings = get_settings()
    configure_threads(settings)
    try:
        factory = open_database(settings)
        with console.status("checking the checkpoint and packing it"):
            done = portable.export_policy(factory, settings.var_dir, policy, out)
    except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail(str(exc))
        return
    recipes = ", ".join(done.recipes) or "none"
    console.print(
        f"exported {done.kind} version [bold]{done.version}[/] to {done.path} "
        f"({done.files} files, {done.bytes / 2**20:.1f} MiB; warm-start recipes: {recipes}; "
        f"made on {done.made_on or 'an unrecorded CPU'})"
    )
    console.print(f"on the other machine: casi policy import {done.path.name}")


@policy_app.command("import")
def import_cmd(
    archive: Annotated[Path, typer.Argument(help="An archive `casi policy export` wrote.")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Folder to unpack into (default var/models/<kind>-<version>)."),
    ] = None,
) -> None:
    """Unpack a policy archive, check every file (sha256) and the weights' content hash against
    the version it claims, register it, and let it answer the warm-start recipes it was made by
    where this machine has no start of its own for them (`casi experiment credit` then finishes
    the seeds begun from it). Importing the same archive again changes nothing."""
    settings = get_settings()
    configure_threads(settings)
    try:
        factory = open_database(settings)
        with console.status(f"checking and unpacking {archive}"):
            done = portable.import_policy(factory, settings.var_dir, archive, out)
    except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail(str(exc))
        return
    console.print(
        f"imported {done.kind} version [bold]{done.version}[/] into {done.folder} "
        f"({'already there' if done.reused_folder else 'checked and unpacked'}; "
        f"{'registered' if done.registered else 'already registered'}; made on "
        f"{done.made_on or 'an unrecorded CPU'})"
    )
    for key in done.claimed:
        console.print(f"warm-start recipe {key}: answered by {done.version}")
    for key, other in done.kept.items():
        console.print(
            f"warm-start recipe {key}: this machine's start {other} kept; {done.version} is used "
            "for the protocol seeds that began from it"
        )
    console.print(f"use it: casi train --policy {done.version}")
