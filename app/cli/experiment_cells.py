"""`casi experiment credit`'s work: the asked cells of one environment prepared once
(:func:`_prepare`: settings with the environment's game → database → the pinned start → retrieval,
scorer, the held-out request) and run one after another (:func:`run_protocol_cells`: per cell the
schedule's decision, then the cell), and the errors of the experiment's commands with where to
read on (:func:`fail_with_guide`). The command itself is in `app.cli.experiment`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

from app.cli.common import fail, open_database
from app.cli.train_display import TrainDisplay
from app.experiments.cell import (
    cell_lock,
    cell_settings,
    evaluate_start,
    held_out_requests,
    pins,
    run_cell,
    start_restorer,
)
from app.experiments.protocol import Environment, Protocol, load_protocol
from app.experiments.result_file import cell_path
from app.experiments.schedule import (
    cell_estimate,
    check_seed_start,
    fits_before,
    half_done_seeds,
    parse_stop_by,
    plan_cell,
    protocol_seeds,
    seed_starts,
)
from app.experiments.start import Start, resolve_start
from app.progress import console, index_progress
from app.runtime import build_retrieval, build_scorer
from app.settings import Settings
from app.training.evaluate import EvalRequest, machine_info
from app.training.policy_loader import LoadedPolicy

GUIDE = "docs/experiments.md"  # how protocols, cells and the aggregate work


def fail_with_guide(exc: BaseException, folder: Path) -> NoReturn:
    """The error, then where to read on: the protocol folder's own README.md, else the guide."""
    text = str(exc)
    readme = Path(folder) / "README.md"
    hint = f"{readme if readme.is_file() else GUIDE} describes the protocol and its cells"
    fail(text if " — " in text else f"{text} — {hint}")


# ---------------------------------------------------------------------------- credit


@dataclass
class Prepared:
    """What every asked cell of one environment shares, built once."""

    protocol: Protocol
    env: Environment
    modes: list[str]
    seeds: list[int]
    folder: Path
    settings: Settings  # the environment's (`cell_settings`)
    factory: Any
    policy: LoadedPolicy
    start: Start
    retrieval: Any
    scorer: Any
    request: EvalRequest
    pin: dict[str, Any]
    shape: str  # "24 steps × 4 × 4; held-out 300 test claims"
    curve: EvalRequest | None = None  # the learning curve's request (the protocol's curve)


def _left(folder: Path, env: Environment, modes: list[str], seed: int) -> bool:
    """Whether some asked cell of ``seed`` has no file yet."""
    return any(not cell_path(folder, env.name, m, seed).is_file() for m in modes)


def _prepare(
    settings: Settings, protocol_file: Path, environment: str | None, modes: list[str],
    seeds_text: str | None, out: Path | None, given: dict[str, Any],
) -> Prepared:  # fmt: skip
    """Check the request, then build what the cells share; ValueError and the like on a bad
    request, before anything heavy is built (a cell another process trains, a seed begun from
    another start: refused here, not after the start)."""
    if given:
        flags = sorted(f"--{k.replace('_', '-')}" for k in given)
        raise ValueError(
            f"--protocol fixes every training setting; drop {', '.join(flags)} "
            "(or write a new protocol, in a new folder)"
        )
    protocol = load_protocol(protocol_file)
    if environment is None:
        raise ValueError(f"--protocol needs --environment (one of {sorted(protocol.environments)})")
    env = protocol.environment(environment)
    chosen = modes or list(env.modes)
    if bad := [m for m in chosen if m not in env.modes]:
        raise ValueError(f"modes {bad} are not in environment {env.name} ({list(env.modes)})")
    seeds = protocol_seeds(env, seeds_text)
    folder = Path(out) if out is not None else Path(protocol_file).parent
    env_settings = cell_settings(settings, protocol, env)
    factory = open_database(env_settings)  # the var folder checked first
    for seed in seeds:
        for mode in chosen:
            with cell_lock(settings.var_dir, folder, protocol, env.name, mode, seed):
                pass
    begun = {  # the starts the asked seeds with cells left began from
        v for seed in seeds if _left(folder, env, chosen, seed) for v in seed_starts(folder, env.name, seed)
    }  # fmt: skip
    with console.status("resolving the pinned start (the protocol's warm-start recipe)"):
        policy, start = resolve_start(protocol, env_settings, factory, begun)
    for seed in seeds:
        if _left(folder, env, chosen, seed):
            check_seed_start(folder, env.name, seed, start)
    r = build_retrieval(
        env_settings, max_docs=protocol.max_docs, progress_factory=index_progress,
        retriever=env.retriever,
    )  # fmt: skip
    scorer = build_scorer("replay", env_settings, r, split="train")
    cfg0 = protocol.train_config(env, chosen[0], seeds[0], env_settings.list_k)
    request, curve = held_out_requests(protocol, r, cfg0.rollout)
    pin = pins(protocol, env, start, r, env_settings)
    shape = (
        f"{cfg0.steps} steps × {cfg0.queries} × {cfg0.samples}; "
        f"held-out {len(request.queries)} {request.split} claims"
    )
    if curve is not None and (c := protocol.curve) is not None:
        shape += f"; a curve on {len(curve.queries)} {curve.split} claims every {c['every']} steps"
    return Prepared(protocol, env, chosen, seeds, folder, env_settings, factory, policy, start,
                    r, scorer, request, pin, shape, curve)  # fmt: skip


def _not_now(p: Prepared, cells: list[tuple[str, int]], i: int, action: str, need: int,
             estimate: Any, now: datetime, deadline: datetime) -> None:  # fmt: skip
    """Say why cell ``i`` does not start before --stop-by (its seed put off, or a stop)."""
    (mode, seed), env = cells[i], p.env
    ends = f"{now + timedelta(seconds=estimate.seconds * need):%H:%M}"
    if action == "put_off":  # a later seed already begun may still fit a cell
        console.print(
            f"not beginning seed {seed} (a seed is begun only whole: its cells share "
            f"one start): its {need} cells are expected to take "
            f"{estimate.seconds * need / 60:.0f} min ({estimate.basis} each), ending at "
            f"{ends}, after --stop-by {deadline:%H:%M}"
        )
        return
    left = [
        f"{m}-seed{s}" for m, s in cells[i:] if not cell_path(p.folder, env.name, m, s).is_file()
    ]
    console.print(
        f"stopping before cell {env.name}/{mode}-seed{seed}: expected to take "
        f"{estimate.seconds / 60:.0f} min ({estimate.basis}), it would end at "
        f"{ends}, after --stop-by {deadline:%H:%M}; not started: {', '.join(left)}"
    )


def _one_cell(
    p: Prepared, mode: str, seed: int, var_dir: Path, restore: Callable[[], None]
) -> None:
    t1 = time.perf_counter()
    cfg = p.protocol.train_config(p.env, mode, seed, p.settings.list_k)
    with TrainDisplay(cfg, 0) as display:
        path, ran = run_cell(
            p.factory, var_dir, p.folder, p.protocol, p.env, mode, seed, retrieval=p.retrieval,
            scorer=p.scorer, policy=p.policy, start=p.start, request=p.request, pin=p.pin,
            list_k=p.settings.list_k, restore=restore, on_step=display.step,
            on_phase=lambda text: console.print(f"  {text}"), curve=p.curve,
        )  # fmt: skip
    done = f"written in {(time.perf_counter() - t1) / 60:.1f} min" if ran else "already done, kept"
    console.print(
        f"cell {p.env.name}/{mode}-seed{seed}: {path} ({done}); commit it: git add {path}"
    )


def run_protocol_cells(
    settings: Settings, protocol_file: Path, environment: str | None, modes: list[str],
    seeds_text: str | None, out: Path | None, given: dict[str, Any], stop_by: str | None = None,
) -> None:  # fmt: skip
    """Run the asked cells of one environment of the protocol, one after another (resumable);
    with ``stop_by``, a cell starts only if its estimate (`cell_estimate`) ends by then."""
    guide = Path(protocol_file).parent
    try:
        deadline = None if stop_by is None else parse_stop_by(stop_by, datetime.now())
        p = _prepare(settings, protocol_file, environment, modes, seeds_text, out, given)
    except (ValueError, FileNotFoundError, LookupError, OSError) as exc:
        fail_with_guide(exc, guide)
    restore, env = start_restorer(p.policy, p.start), p.env
    console.print(
        f"protocol [bold]{p.protocol.name}[/] ({p.protocol.hash}), environment {env.name}: "
        f"{env.retriever}/{env.merge}, m={env.n_actions}; start {p.start.version} (recipe {p.start.recipe}); "
        f"modes {p.modes} × seeds {p.seeds}; {p.shape} → {p.folder / env.name}"
    )
    t0 = time.perf_counter()
    path = evaluate_start(p.factory, p.folder, p.protocol, env, p.start, p.policy, p.request, p.pin)
    console.print(f"start evaluation: {path} ({time.perf_counter() - t0:.0f}s)")
    family = machine_info()["cpu_family"]
    cells = [(m, s) for s in p.seeds for m in p.modes]
    put_off: set[int] = set()  # seeds not begun: all their asked cells would not fit
    for i, (mode, seed) in enumerate(cells):
        estimate = cell_estimate(p.folder, env.name, family)
        now = datetime.now()
        action, need = plan_cell(
            p.folder, env.name, cells, i, put_off,
            lambda n: fits_before(deadline, estimate, now, n),  # noqa: B023 - called at once
        )  # fmt: skip
        if action in ("put_off", "stop"):
            assert deadline is not None and estimate.seconds is not None
            _not_now(p, cells, i, action, need, estimate, now, deadline)
            if action == "stop":
                break
            put_off.add(seed)
        if action != "run":
            continue
        console.rule(f"cell {i + 1}/{len(cells)}: {env.name}, credit {mode}, seed {seed}")
        try:
            _one_cell(p, mode, seed, settings.var_dir, restore)
        except (ValueError, FileNotFoundError, LookupError) as exc:
            fail_with_guide(exc, guide)
    _hand_over(p)


def _hand_over(p: Prepared) -> None:
    """Name the seeds begun from this start and not finished: another machine can finish them
    from this very start once it is exported."""
    version = p.start.version
    if half := half_done_seeds(p.folder, p.env, p.seeds, version):
        many = len(half) > 1
        console.print(
            f"seed{'s' * many} {', '.join(map(str, half))} began from start {version} and "
            f"{'are' if many else 'is'} not finished; another machine can finish "
            f"{'them' if many else 'it'} from this very start: casi policy export {version} "
            f"--out start-{version}.tar here, then casi policy import there",
            markup=False, highlight=False, soft_wrap=True,
        )  # fmt: skip
