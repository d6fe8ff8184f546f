"""``casi rewrite`` (serve rewrites from a policy) and ``casi policy warmstart`` (format SFT)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from sqlalchemy.engine import make_url

from app.cli.common import LineCapOpt, MaxNewTokensOpt, fail
from app.cli.common import PolicyOpt as CommonPolicyOpt
from app.progress import console, progress_bar
from app.settings import get_settings

policy_app = typer.Typer(
    help="The rewrite policy: warm start and checkpoints.", no_args_is_help=True
)
VERSION_FILE = "casi-version.txt"  # the policy version a warm-start folder holds
PolicyOpt = Annotated[
    str | None,
    typer.Option("--policy", help="Local HF model folder (default SmolLM2-135M-Instruct)."),
]


def rewrite(
    query: Annotated[str, typer.Option("--query", help="The user query to rewrite.")],
    n_actions: Annotated[int, typer.Option("--n-actions", min=1, max=12)] = 4,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Independent generations.")] = 1,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.7,
    format: Annotated[
        str, typer.Option("--format", help="constrained (exactly m lines) | free.")
    ] = "constrained",
    line_cap: LineCapOpt = None,
    max_new_tokens: MaxNewTokensOpt = None,
    seed: int = 0,
    policy: CommonPolicyOpt = None,
) -> None:
    """Sample m rewrites of a query in ONE generation and print them with their token spans."""

    from app.limits import check_text
    from app.training.policy_loader import load_policy_ref
    from policy.constrain import DEFAULT_LINE_CAP, free_response_cap
    from policy.rollout import sample_rollouts
    from policy.sampler import SamplerConfig

    query = check_text(query, "--query")  # before the policy loads
    settings = get_settings()
    line_cap = line_cap or DEFAULT_LINE_CAP
    try:
        if format not in ("constrained", "free"):
            raise ValueError(f"--format must be constrained or free, got {format!r}")
        if format == "constrained" and max_new_tokens is not None:
            raise ValueError("--max-new-tokens applies to --format free only (set --line-cap)")
        with console.status("loading the policy (the first time converts the GGUF, ~40 s)"):
            loaded = load_policy_ref(policy, settings.var_dir, _factory_or_none(settings))
        model, tok = loaded.model, loaded.tokenizer
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
        line_cap=line_cap,
    )  # fmt: skip
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
    prompt: Annotated[
        str, typer.Option(help="Prompt style to teach: oneshot (with the worked example) | short.")
    ] = "oneshot",
    train_precision: Annotated[
        str,
        typer.Option(
            help="float32 | bfloat16 (autocast; ~3x faster on AMX CPUs, 65x SLOWER where bf16 is "
            "emulated) | auto (bf16 only where native)."
        ),
    ] = "float32",
) -> None:
    """SFT on the TRAIN split (minus the validation slice) teaching the numbered-rewrite format;
    checkpoint registered in the DB.

    The database and var dir are checked first; re-running the same warm start reuses its
    checkpoint and registration (idempotent); concurrent runs write the output one at a time."""
    from app.runtime import preflight
    from evaluator.artifacts import build_lock
    from evaluator.corpus import load_dataset
    from policy.model import load_policy, policy_version
    from policy.warmstart import make_warmstart_examples, warmstart

    settings = get_settings()
    preflight(settings, database=True)  # fail in seconds, not after the training
    ds = load_dataset(settings.dataset, splits=("train",))
    title = {d.doc_id: d.title for d in ds.documents}
    from app.training.splits import train_val_ids
    from policy.sampler import resolve_precision

    train_precision = resolve_precision(train_precision, get_settings().resolved_device())
    if prompt not in ("oneshot", "short") or train_precision not in ("float32", "bfloat16"):
        fail("--prompt must be oneshot or short, --train-precision float32, bfloat16 or auto")
    qids = train_val_ids(ds)[0][:queries]  # never the validation slice
    items = [(ds.queries[q], [title[d] for d in ds.qrels["train"][q]]) for q in qids]
    examples = make_warmstart_examples(items, n_actions, seed=seed)
    with console.status("loading the policy"):
        model, tok = load_policy(policy, settings.var_dir, progress=False)
    parent = policy_version(model)
    recipe = _recipe_key(parent, examples, steps, batch_size, lr, seed, prompt, train_precision)
    # Identical runs at once: the second waits for the first, then reuses what it wrote.
    guard = (
        build_lock(_recipe_index(settings.var_dir) / recipe, f"the warm start {recipe}")
        if out is None
        else contextlib.nullcontext()
    )
    with guard:
        done = _cached_warmstart(settings.var_dir, recipe) if out is None else None
        if done is not None:  # the same inputs were trained before: reuse, do not train again
            console.print(
                f"warm start reused: {done} (same policy, data and settings; recipe {recipe})"
            )
            console.print(f"use it: casi train --policy {done}")
            return
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
                prompt_style=prompt,
                train_precision=train_precision,
            )
        version = policy_version(model)
        target = out or settings.var_dir / "models" / f"warmstart-{version}"
        with build_lock(target, f"the warm-start output {target}"):
            folder, reused = _save_once(model, tok, target, version)
            new = _register(
                settings,
                parent=parent,
                version=version,
                folder=folder,
                policy=policy,
                meta={
                    "losses": [float(x) for x in metrics.losses],
                    "examples": len(examples),
                    "lr": lr,
                    "prompt": prompt,
                    "train_precision": train_precision,
                },
                steps=steps,
            )
        if out is None:
            _recipe_index(settings.var_dir).joinpath(recipe).write_text(str(folder))
    shown = make_url(settings.sqlalchemy_url).render_as_string(hide_password=True)
    console.print(
        f"loss {metrics.losses[0]:.3f} → {metrics.losses[-1]:.3f}; checkpoint {folder} "
        f"({'reused' if reused else 'saved'}, version {version}, "
        f"{'registered in' if new else 'already registered in'} {shown})"
    )
    console.print(f"use it: casi train --policy {folder}")


def _recipe_key(parent: str, examples: Any, *settings: Any) -> str:
    """Content hash of everything a warm start depends on (start weights, data, settings)."""
    import hashlib
    import json

    data = json.dumps([parent, [(e.query, e.answer) for e in examples], list(settings)])
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def _recipe_index(var_dir: Path) -> Path:
    folder = Path(var_dir) / "models" / "recipes"  # recipe hash → warm-start folder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _cached_warmstart(var_dir: Path, recipe: str) -> Path | None:
    """The intact checkpoint an earlier run of the same recipe wrote, if any."""
    from evaluator.artifacts import ArtifactError
    from policy.model import check_model_folder

    entry = _recipe_index(var_dir) / recipe
    if not entry.is_file():
        return None
    folder = Path(entry.read_text().strip())
    try:
        check_model_folder(folder)
    except (ArtifactError, OSError):
        return None
    return folder


def _save_once(model: Any, tok: Any, target: Path, version: str) -> tuple[Path, bool]:
    """(folder, reused): an intact checkpoint of this very version at ``target`` is kept."""
    from evaluator.artifacts import ArtifactError
    from policy.model import check_model_folder, save_checkpoint

    marker = target / VERSION_FILE
    if marker.is_file() and marker.read_text(encoding="utf-8").strip() == version:
        try:
            check_model_folder(target)
            return target, True
        except ArtifactError:
            pass  # damaged: written again below

    return save_checkpoint(model, tok, target, extra_files={VERSION_FILE: version + "\n"}), False


def _register(
    settings: Any,
    *,
    parent: str,
    version: str,
    folder: Path,
    policy: str | None,
    meta: dict[str, Any],
    steps: int,
) -> bool:
    """Register base + warm-start versions unless present (idempotent); True if new."""
    from app.db import repositories as repo
    from app.db import session_scope
    from app.db.session import make_engine, make_session_factory

    engine = make_engine(settings.sqlalchemy_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            if repo.get_policy_version_by_version(session, version) is not None:
                return False
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
                meta=meta,
            )
            return True
    finally:
        engine.dispose()


def _factory_or_none(settings: Any) -> Any:
    """A session factory when the database is reachable (to resolve versions), else None."""
    from app.db.session import make_engine, make_session_factory

    try:
        engine = make_engine(settings.sqlalchemy_url)
        with engine.connect():
            pass
    except Exception:  # no database: folders and the default still work
        return None
    return make_session_factory(engine)


@policy_app.command("merge")
def merge_cmd(
    policy: Annotated[str, typer.Argument(help="A LoRA checkpoint: version, prefix or folder.")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Folder of the merged weights (default beside).")
    ] = None,
) -> None:
    """Merge a LoRA adapter checkpoint into full weights, saved and registered as a version."""
    from app.cli.train import open_database
    from app.db import repositories as repo
    from app.db import session_scope
    from app.training.policy_loader import resolve_path
    from policy.model import load_policy, policy_version, save_checkpoint
    from policy.params import adapter_base, is_adapter_folder

    settings = get_settings()
    try:
        factory = open_database(settings)
        path, name, _ = resolve_path(policy, factory)
        folder = Path(path) if path else None
        if folder is None or not is_adapter_folder(folder):
            raise ValueError(f"{policy} is not a LoRA adapter checkpoint (nothing to merge)")
        with console.status("loading the base and merging the adapter"):
            model, tok = load_policy(folder, settings.var_dir, progress=False)
        target = out or folder.with_name(folder.name + "-merged")
        save_checkpoint(model, tok, target)
        version = policy_version(model)
        with session_scope(factory) as session:
            parent = repo.get_policy_version_by_version(
                session, adapter_base(folder)["base_version"]
            )
            pv = repo.get_or_add_policy_version(
                session, version=version, name=f"{name}-merged", base_model="merged LoRA",
                path=str(target), kind="trained", parent_id=parent.id if parent else None,
                meta={"merged_from": str(folder)},
            )  # fmt: skip
            # the adapter's version IS the hash of the merged weights it serves: the same row,
            # now pointing at the full weights (faster to load), the adapter kept in its meta
            pv.meta = {**(pv.meta or {}), "adapter": str(folder)}
            pv.path = str(target)
    except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail(str(exc))
        return
    console.print(f"merged: version [bold]{version}[/] (full weights) in {target}")
