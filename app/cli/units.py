"""`casi experiment credit --protocol …` (cells of a pre-registered protocol) and
`casi experiment aggregate <folder>` (every committed cell turned into the answer).

The composition root of `app.training.units`: settings with the environment's retrieval game →
database → the pinned start (the warm start the protocol's recipe names, found by its recipe
hash; never "the newest warm start") → retrieval, scorer, the held-out request → one cell after
another, each from the start's weights.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

from app.cli.common import fail, open_database
from app.cli.train_display import TrainDisplay
from app.progress import console, index_progress
from app.runtime import build_retrieval, build_scorer
from app.settings import Settings
from app.training import warmstart as recipe
from app.training.evaluate import held_out_request, machine_info
from app.training.policy_loader import LoadedPolicy, load_policy_ref
from app.training.splits import split_ids
from app.training.units import Start, cell_lock, cell_path, evaluate_start, pins, run_cell
from app.training.units_aggregate import aggregate
from app.training.units_protocol import (
    MAX_SEEDS,
    SEED_LIMIT,
    Environment,
    Protocol,
    load_protocol,
)
from app.training.units_schedule import (
    CellEstimate,
    cell_estimate,
    check_seed_start,
    half_done_seeds,
    pick_start,
    plan_cell,
    seed_starts,
)
from evaluator.corpus import load_dataset
from policy.model import policy_version
from policy.warmstart import DEFAULT_WORDS

GUIDE = "docs/experiments.md"  # how protocols, cells and the aggregate work


def fail_with_guide(exc: BaseException, folder: Path) -> NoReturn:
    """The error, then where to read on: the protocol folder's own README.md, else the guide."""
    text = str(exc)
    readme = Path(folder) / "README.md"
    hint = f"{readme if readme.is_file() else GUIDE} describes the protocol and its cells"
    fail(text if " — " in text else f"{text} — {hint}")


SEEDS_SYNTAX = (
    "seeds are a comma list of seeds and ranges: 0 (seed 0 alone), 0,2,5, 0-5 (seeds 0 to 5), "
    f"0-2,7; ASCII digits, at most {MAX_SEEDS} seeds, each below {SEED_LIMIT}"
)
SEED_ITEM = re.compile(r"(?P<low>[0-9]{1,10})(?:-(?P<high>[0-9]{1,10}))?")


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: ``0`` (seed 0 alone), ``0,2,5``, ``0-5`` (0 to 5 inclusive), mixed
    (``0-2,7``); one trailing comma is allowed (``5,``). ASCII digits only, distinct seeds, at
    most `MAX_SEEDS`, each below `SEED_LIMIT`; anything else is a ValueError stating the syntax."""

    def bad(reason: str) -> ValueError:
        shown = repr(text) if len(text) <= 40 else repr(text[:37]) + "..."
        return ValueError(f"--seeds {shown}: {reason}; {SEEDS_SYNTAX}")

    items = text.strip(" ").split(",")
    if len(items) > 1 and not items[-1].strip(" "):
        items.pop()  # "5,": seed 5
    seeds: list[int] = []
    for item in items:
        match = SEED_ITEM.fullmatch(item.strip(" "))
        if match is None:
            raise bad(
                f"{item.strip(' ')!r} is neither a seed nor a range"
                if item.strip(" ")
                else "an empty item"
            )
        low = int(match["low"])
        high = int(match["high"]) if match["high"] is not None else low
        if high >= SEED_LIMIT:
            raise bad(f"{high} is not below {SEED_LIMIT}")
        if high < low:
            raise bad(f"the range {low}-{high} runs backwards")
        if len(seeds) + high - low + 1 > MAX_SEEDS:
            raise bad(f"more than {MAX_SEEDS} seeds")
        seeds.extend(range(low, high + 1))
    if len(set(seeds)) != len(seeds):
        raise bad(f"seed {next(s for s in seeds if seeds.count(s) > 1)} is named twice")
    return seeds


def protocol_seeds(env: Environment, text: str | None) -> list[int]:
    """The seeds of ``env`` to run: ``--seeds`` (every one planned by the protocol), or all the
    planned ones (0..seeds-1) when it is not given."""
    if text is None:
        return list(range(env.seeds))
    seeds = parse_seeds(text)
    if outside := [s for s in seeds if s >= env.seeds]:
        raise ValueError(
            f"--seeds {text!r} names seed {outside[0]}, which the protocol does not plan: "
            f"environment {env.name} has seeds {env.planned()}"
        )
    return seeds


def parse_stop_by(text: str, now: datetime) -> datetime:
    """``--stop-by``: ``HH:MM`` (local time: today, or tomorrow when it is already past) or an
    ISO date-time (``2026-12-05T08:50``); a naive time is local. ValueError stating the syntax."""
    value = text.strip()
    clock = re.fullmatch(r"([0-9]{1,2}):([0-9]{2})", value)
    if clock is not None:
        hour, minute = int(clock[1]), int(clock[2])
        if hour > 23 or minute > 59:
            raise ValueError(f"--stop-by {text!r}: no such time of day (HH:MM, 00:00 to 23:59)")
        at = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
        return at if at > now else at + timedelta(days=1)
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"--stop-by {text!r}: give HH:MM (local time) or an ISO date-time "
            "such as 2026-12-05T08:50"
        ) from None
    if at.tzinfo is not None:
        at = at.astimezone().replace(tzinfo=None)
    if at <= now:
        raise ValueError(f"--stop-by {text!r} is already past (now {now:%Y-%m-%d %H:%M})")
    return at


def fits_before(
    stop_by: datetime | None, estimate: CellEstimate, now: datetime, cells: int = 1
) -> bool:
    """Whether ``cells`` cells, each expected to take ``estimate``, end by ``stop_by`` (always,
    with no stop time or nothing to estimate from: the first cell of a folder is how one
    learns)."""
    if stop_by is None or estimate.seconds is None:
        return True
    return now + timedelta(seconds=estimate.seconds * cells) <= stop_by


def warmstart_command(start: dict[str, Any], dataset: str | None = None) -> str:
    """The command that makes the protocol's start (with the protocol's dataset, if it names one)."""
    flags = " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in sorted(start.items()) if k != "policy"
    )
    return f"{f'CASI_DATASET={dataset} ' if dataset else ''}casi policy warmstart {flags}"


def resolve_start(
    protocol: Protocol, settings: Settings, factory: Any, begun: Collection[str] = ()
) -> tuple[LoadedPolicy, Start]:
    """The warm start the protocol's recipe names (its recipe hash → its folder), loaded: the one
    of ``begun`` (the starts the asked seeds began from) that this machine holds, made here or
    imported (`casi policy import`), else the one the recipe index names."""
    s = protocol.start
    if not any(recipe.recipe_index(settings.var_dir).iterdir()):  # no warm start at all here
        raise FileNotFoundError(
            f"no warm start on this machine; the protocol's start is made by `{warmstart_command(s, protocol.dataset)}`"
        )
    base = load_policy_ref(s.get("policy"), settings.var_dir, factory)
    ds = load_dataset(settings.dataset, splits=("train",))
    source, words = s.get("source", "titles"), int(s.get("words", DEFAULT_WORDS))
    examples = recipe.warmstart_examples(
        ds, int(s["n_actions"]), s.get("queries"), int(s["seed"]), source, words
    )
    key = recipe.recipe_key(
        base.version, examples, int(s["steps"]), int(s["batch_size"]), float(s["lr"]),
        int(s["seed"]), s["prompt"], s["train_precision"], *recipe.recipe_extra(source, words, None),
    )  # fmt: skip
    del base
    picked = pick_start(
        recipe.recipe_starts(settings.var_dir, key),
        recipe.cached_warmstart(settings.var_dir, key),
        begun,
    )
    if picked is None:
        raise FileNotFoundError(
            f"the protocol's start (warm-start recipe {key}) is not on this machine: run "
            f"`{warmstart_command(s, protocol.dataset)}` first (or `casi policy import` the "
            "start a seed began from)"
        )
    policy = load_policy_ref(
        str(picked.folder), settings.var_dir, factory, device=settings.resolved_device()
    )
    return policy, Start(policy.version, key, dict(s), picked.imported, picked.made_on)


def cell_settings(settings: Settings, protocol: Protocol, env: Environment) -> Settings:
    """The settings every cell of ``env`` runs under: its game (the game, retriever, merge rule,
    rrf k and, where the protocol names them, the depth k and the dataset) and the BM25 stemmer
    and rules the protocol's environment table names (``bm25_stemmer``, ``bm25_rules``), ``none``
    and 1 when it names none — so a protocol written before CASI_BM25_STEMMER and
    CASI_BM25_RULES existed keeps the index and the lists its cells pinned, whatever this
    machine's default or environment says."""
    table = protocol.raw.get("environments", {}).get(env.name, {})
    stemmer = table.get("bm25_stemmer", "none")  # one of BM25_STEMMER_SETTINGS (load_protocol)
    update: dict[str, Any] = {"retriever": env.retriever, "merge": env.merge, "rrf_k": env.rrf_k,
                              "game": env.game, "bm25_stemmer": stemmer,
                              "bm25_rules": table.get("bm25_rules", 1)}  # fmt: skip
    if env.retrieval_k is not None:
        update["retrieval_k"] = env.retrieval_k
    if protocol.dataset is not None:
        update["dataset"] = Path(protocol.dataset)
    return settings.model_copy(update=update)


def run_protocol_cells(
    settings: Settings,
    protocol_file: Path,
    environment: str | None,
    modes: list[str],
    seeds_text: str | None,
    out: Path | None,
    given: dict[str, Any],
    stop_by: str | None = None,
) -> None:
    """Run the asked cells of one environment of the protocol, one after another (resumable);
    with ``stop_by``, a cell starts only if its estimate (`cell_estimate`) ends by then."""
    try:
        deadline = None if stop_by is None else parse_stop_by(stop_by, datetime.now())
        if given:
            flags = sorted(f"--{k.replace('_', '-')}" for k in given)
            raise ValueError(
                f"--protocol fixes every training setting; drop {', '.join(flags)} "
                "(or write a new protocol, in a new folder)"
            )
        protocol = load_protocol(protocol_file)
        if environment is None:
            raise ValueError(
                f"--protocol needs --environment (one of {sorted(protocol.environments)})"
            )
        env = protocol.environment(environment)
        chosen = modes or list(env.modes)
        if bad := [m for m in chosen if m not in env.modes]:
            raise ValueError(f"modes {bad} are not in environment {env.name} ({list(env.modes)})")
        seeds = protocol_seeds(env, seeds_text)
        folder = Path(out) if out is not None else Path(protocol_file).parent
        env_settings = cell_settings(settings, protocol, env)
        factory = open_database(env_settings)  # the var folder checked first
        for seed in seeds:  # a cell another process trains: refused now, not after the start
            for mode in chosen:
                with cell_lock(settings.var_dir, folder, protocol, env.name, mode, seed):
                    pass
        begun = {  # the starts the asked seeds with cells left began from
            version
            for seed in seeds
            if any(not cell_path(folder, env.name, m, seed).is_file() for m in chosen)
            for version in seed_starts(folder, env.name, seed)
        }
        with console.status("resolving the pinned start (the protocol's warm-start recipe)"):
            policy, start = resolve_start(protocol, env_settings, factory, begun)
        for seed in seeds:  # a seed begun elsewhere, with cells left: refused now
            if any(not cell_path(folder, env.name, m, seed).is_file() for m in chosen):
                check_seed_start(folder, env.name, seed, start)
        r = build_retrieval(
            env_settings, max_docs=protocol.max_docs, progress_factory=index_progress,
            retriever=env.retriever,
        )  # fmt: skip
        scorer = build_scorer("replay", env_settings, r, split="train")
        split = protocol.evaluation.get("split", "test")
        asked = protocol.evaluation["queries"]
        n_eval = len(split_ids(r.dataset, split)) if asked == "all" else int(asked)
        cfg0 = protocol.train_config(env, chosen[0], seeds[0], env_settings.list_k)
        request = held_out_request(r, cfg0.rollout, split, n_eval)
        pin = pins(protocol, env, start, r, env_settings)
    except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail_with_guide(exc, Path(protocol_file).parent)
    weights = {k: v.clone() for k, v in policy.model.state_dict().items()}

    def restore() -> None:
        policy.model.load_state_dict(weights)
        if policy_version(policy.model) != start.version:
            raise RuntimeError("the start weights did not come back intact")

    console.print(
        f"protocol [bold]{protocol.name}[/] ({protocol.hash}), environment {env.name}: "
        f"{env.retriever}/{env.merge}, m={env.n_actions}; start {start.version} (recipe {start.recipe}); "
        f"modes {chosen} × seeds {seeds}; {cfg0.steps} steps × {cfg0.queries} × {cfg0.samples}; "
        f"held-out {n_eval} {split} claims → {folder / env.name}"
    )
    cells = [(m, s) for s in seeds for m in chosen]
    t0 = time.perf_counter()
    path = evaluate_start(factory, folder, protocol, env, start, policy, request, pin)
    console.print(f"start evaluation: {path} ({time.perf_counter() - t0:.0f}s)")
    family = machine_info()["cpu_family"]
    put_off: set[int] = set()  # seeds not begun: all their asked cells would not fit
    for i, (mode, seed) in enumerate(cells):
        estimate = cell_estimate(folder, env.name, family)
        now = datetime.now()
        action, need = plan_cell(
            folder, env.name, cells, i, put_off,
            lambda n: fits_before(deadline, estimate, now, n),  # noqa: B023 - called at once
        )  # fmt: skip
        if action == "skip":
            continue
        if action != "run":
            assert deadline is not None and estimate.seconds is not None
            ends = f"{now + timedelta(seconds=estimate.seconds * need):%H:%M}"
            if action == "put_off":  # a later seed already begun may still fit a cell
                put_off.add(seed)
                console.print(
                    f"not beginning seed {seed} (a seed is begun only whole: its cells share "
                    f"one start): its {need} cells are expected to take "
                    f"{estimate.seconds * need / 60:.0f} min ({estimate.basis} each), ending at "
                    f"{ends}, after --stop-by {deadline:%H:%M}"
                )
                continue
            left = [
                f"{m}-seed{s}"
                for m, s in cells[i:]
                if not cell_path(folder, env.name, m, s).is_file()
            ]
            console.print(
                f"stopping before cell {env.name}/{mode}-seed{seed}: expected to take "
                f"{estimate.seconds / 60:.0f} min ({estimate.basis}), it would end at "
                f"{ends}, after --stop-by {deadline:%H:%M}; not started: {', '.join(left)}"
            )
            break
        console.rule(f"cell {i + 1}/{len(cells)}: {env.name}, credit {mode}, seed {seed}")
        t1 = time.perf_counter()
        cfg = protocol.train_config(env, mode, seed, env_settings.list_k)
        try:
            with TrainDisplay(cfg, 0) as display:
                path, ran = run_cell(
                    factory, settings.var_dir, folder, protocol, env, mode, seed, retrieval=r,
                    scorer=scorer, policy=policy, start=start, request=request, pin=pin,
                    list_k=env_settings.list_k, restore=restore, on_step=display.step,
                    on_phase=lambda text: console.print(f"  {text}"),
                )  # fmt: skip
        except (ValueError, FileNotFoundError, LookupError) as exc:
            fail_with_guide(exc, Path(protocol_file).parent)
        done = (
            f"written in {(time.perf_counter() - t1) / 60:.1f} min" if ran else "already done, kept"
        )
        console.print(
            f"cell {env.name}/{mode}-seed{seed}: {path} ({done}); commit it: git add {path}"
        )
    if half := half_done_seeds(folder, env, seeds, start.version):
        console.print(
            f"seed{'s' * (len(half) > 1)} {', '.join(map(str, half))} began from start "
            f"{start.version} and {'are' if len(half) > 1 else 'is'} not finished; another "
            f"machine can finish {'them' if len(half) > 1 else 'it'} from this very start: "
            f"casi policy export {start.version} --out start-{start.version}.tar here, then "
            "casi policy import there",
            markup=False, highlight=False, soft_wrap=True,
        )  # fmt: skip


def aggregate_cmd(folder: Path) -> None:
    """Pair every committed cell of the protocol in FOLDER by seed and claim: table.md (means ±
    sd over seeds, per-seed values, every pre-registered comparison with CI, p and Holm p) and
    ndcg.png. Reads files only; the same files give the same bytes. Every file is checked first
    (its values, its name, its seed, its start) and nothing is written unless all pass."""
    try:
        result = aggregate(folder)
    except (ValueError, FileNotFoundError) as exc:
        fail_with_guide(exc, folder)
    console.print((Path(folder) / "table.md").read_text(), markup=False)
    n = sum(e["cells"] for e in result["environments"].values())
    console.print(f"{n} cells → {Path(folder) / 'table.md'}, {Path(folder) / 'ndcg.png'}")
