"""The credit experiment as pre-registered cells (`casi experiment credit --protocol`).

Read :func:`run_cell`. A *protocol* (a TOML file, `app.experiments.protocol`) fixes everything an
answer depends on: the start recipe, the training settings, the held-out evaluation, the
environments (retriever × merge rule × anchor × m, each with its credit modes), the hypotheses
and the analysis. Its hash (:func:`protocol_hash`, over the parsed content, not the comments)
is written into every result, and `casi experiment aggregate` refuses results of another hash.

A *cell* is one environment × one credit mode × one seed: trained from the pinned start (the
warm start its recipe names, identified by its weight hash), then evaluated on the protocol's
held-out claims (greedy, float32). It writes ONE small file,
``<out>/<environment>/<mode>-seed<K>.json`` (:func:`cell_path`), atomically, when it finishes:
per-claim nDCG@10 and recall@100 of query + rewrites, the per-step training metrics, the pins
(:func:`pins`) and the compute. The start's own evaluation depends on the start weights and the
environment only, so it is written once per start hash: ``<out>/<environment>/start-<hash>.json``.

A protocol whose [evaluation] names a learning curve (``curve_split``, ``curve_every``,
``curve_queries``) has every cell evaluate its policy on that split (dev or val, never test)
every ``curve_every`` steps and at its last one, inside the training loop
(`app.training.train.run_training`'s held-out evaluation): its file records ``curve``, one
point per evaluation (`app.experiments.result_file.curve_point`), kept in the cell's sidecar
as they come so that a killed cell keeps the points it made.

Resume: a cell's training run id lives in ``var/units/<protocol hash>/<environment>/``; a killed
cell resumes its run exactly (`app.training.runs.resume_run`), so the file it writes equals an
uninterrupted cell's but for its ``compute`` section (wall time, machines). A finished cell (its
file exists) is skipped. A cell is trained by one process at a time: :func:`cell_lock`, the
inter-process lock of `evaluator.artifacts` on its run's record, is held for the cell's whole
training and evaluation, and a second process asking for the same cell is refused, told the
holder's pid — also one with another var folder writing the same results folder (a second lock
sits beside the result file). Every file is checked when read (`app.experiments.result_file`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.experiments.protocol import Environment, Protocol
from app.experiments.result_file import (
    CELL_FORMAT,
    START_FORMAT,
    cell_path,
    curve_point,
    read_result,
    start_path,
    write_json,
)
from app.experiments.start import Start
from app.runtime import Retrieval
from app.settings import Settings
from app.training.evaluate import EvalRequest, evaluate_and_store, held_out_request, machine_info
from app.training.policy_loader import LoadedPolicy, register_policy
from app.training.runs import RunHandle, open_run, resume_run
from app.training.splits import split_ids
from app.training.train import checkpoint_run, run_training
from evaluator.locks import holder_text, lock_if_free
from policy.evaluate import LISTS, EvalResult, HeldOutConfig
from policy.model import policy_version
from policy.precision import sampler_kernels
from policy.rollout import RolloutConfig
from policy.train_config import TrainConfig

STEP_METRICS_DROPPED = ("time/", "cache/")
"""Per-step metrics a cell file leaves out: wall times (in ``compute`` instead) and Redis cache
counters (they depend on what the cache held before), neither a property of the run."""


def folder_checksum(folder: Path) -> str | None:
    """sha256 (16 hex) over every file under ``folder`` (relative names and bytes, sorted)."""
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(folder)).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------- pins


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


def pins(
    protocol: Protocol, env: Environment, start: Start, retrieval: Any, settings: Any
) -> dict[str, Any]:
    """Everything a cell's number depends on beside the protocol: start, index, depth,
    precisions (pinned, never auto), library versions, the CPU."""
    import torch
    import transformers

    index = retrieval.index
    return {
        "start_version": start.version,
        "start_recipe": start.recipe,
        "index_version": index.version,
        "index_docs": len(index),
        "index_checksum": folder_checksum(Path(settings.var_dir) / "index" / index.version),
        "retriever": env.retriever,
        "merge": env.merge,
        "rrf_k": env.rrf_k,
        "anchor": env.anchor,
        "n_actions": env.n_actions,
        "retrieval_k": int(settings.retrieval_k),
        "game": env.game,
        "dataset": str(settings.dataset),
        "dataset_checksum": folder_checksum(Path(settings.dataset)),
        "list_k": int(settings.list_k),
        "precision": {
            "sampler": protocol.training["precision"],
            "train": protocol.training["train_precision"],
            "eval": "float32",
            "start": start.settings["train_precision"],
        },
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_model": machine_info()["cpu_model"],
        "cpu_family": machine_info()["cpu_family"],
        "isa_flags": machine_info()["isa_flags"],
        "threads": int(settings.threads),
        "device": str(settings.resolved_device()),
        "sampler_kernels": sampler_kernels(settings.resolved_device()),
    }


def _eval_rows(result: EvalResult) -> dict[str, Any]:
    """Per-claim values of one evaluation (the lists are `policy.evaluate.LISTS`: query,
    rewrites, combined = query + rewrites, what CASI serves)."""
    rows = result.per_query
    combined, query = LISTS.index("combined"), LISTS.index("query")
    return {
        "claims": [str(r["query_id"]) for r in rows],
        "ndcg@10": [float(r["ndcg"][combined]) for r in rows],
        "recall@100": [float(r["recall"][combined]) for r in rows],
        "query_ndcg@10": [float(r["ndcg"][query]) for r in rows],
        "rewrites": [list(r["rewrites"]) for r in rows],
        "eval_metrics": {k: float(v) for k, v in sorted(result.metrics.items())},
        **(_pool_rows(rows) if rows and "pool" in rows[0] else {}),
    }


def _pool_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The pooled game's per-claim values (`policy.evaluate._pool_metrics`): graded recall of
    the pools, the equal-budget and keyword-expansion baselines, the overlap of the rewrites'
    lists (the share of the gain from documents one rewrite found is per cell, in
    ``eval_metrics``: a claim without a gain has none) and, where the game serves a re-ranked
    pool, the served nDCG@10 of query + rewrites and of keyword expansion."""
    combined, query = LISTS.index("combined"), LISTS.index("query")
    served = (
        {"served_ndcg@10": [float(r["served_ndcg"]) for r in rows],
         "prf_served_ndcg@10": [float(r["prf_served_ndcg"]) for r in rows]}
        if all("served_ndcg" in r and "prf_served_ndcg" in r for r in rows) else {}
    )  # fmt: skip
    return {
        **served,
        "pool_recall": [float(r["pool"][combined]) for r in rows],
        "query_pool_recall": [float(r["pool"][query]) for r in rows],
        "budget_recall": [float(r["budget"]) for r in rows],
        "prf_recall": [float(r["prf"]) for r in rows],
        "prf_ndcg@10": [float(r["prf_ndcg"]) for r in rows],
        "overlap": [float(r["overlap"]) for r in rows],
    }


def held_out_requests(
    protocol: Protocol, retrieval: Retrieval, rollout: RolloutConfig
) -> tuple[EvalRequest, EvalRequest | None]:
    """The protocol's held-out request (its [evaluation] split and queries, for the start and
    every cell) and its learning curve's (None without one), for a cell's rollout shape; both
    decode with serving's degenerate guard where the protocol says (``refuse_degenerate``)."""
    guard = protocol.refuse_degenerate

    def request(split: str, asked: Any) -> EvalRequest:
        n = len(split_ids(retrieval.dataset, split)) if asked == "all" else int(asked)
        return held_out_request(retrieval, rollout, split, n, guard)

    held = request(protocol.evaluation.get("split", "test"), protocol.evaluation["queries"])
    c = protocol.curve  # settings are chosen on dev / val, never on test
    return held, (None if c is None else request(c["split"], c["queries"]))


def evaluate_start(
    factory: sessionmaker[Session],
    out: Path,
    protocol: Protocol,
    env: Environment,
    start: Start,
    policy: LoadedPolicy,
    request: EvalRequest,
    pin: dict[str, Any],
) -> Path:
    """The start's evaluation in this environment, once per start hash (kept if present)."""
    path = start_path(out, env.name, start.version)
    if path.is_file():
        _check_protocol(read_result(path), protocol, path)
        return path
    t0 = time.perf_counter()
    result = evaluate_and_store(
        factory,
        policy.model,
        policy.tokenizer,
        request,
        policy_version_id=register_policy(factory, policy),
    )
    write_json(path, {
        "format": START_FORMAT, "protocol": {"name": protocol.name, "hash": protocol.hash},
        "environment": env.name, "start": start.pin(),
        "pins": pin, **_eval_rows(result),
        "compute": {"eval_s": round(time.perf_counter() - t0, 1), "machine": machine_info()},
    })  # fmt: skip
    return path


def _check_protocol(data: Mapping[str, Any], protocol: Protocol, path: Path) -> None:
    if data.get("protocol", {}).get("hash") != protocol.hash:
        raise ValueError(
            f"{path} was made under protocol {data.get('protocol')}, not {protocol.name} "
            f"({protocol.hash}): a changed protocol needs a new folder (--out)"
        )


def _step_rows(metrics_path: Path) -> tuple[list[dict[str, Any]], list[float]]:
    """Per-step metrics (no wall times, no cache counters) and the step wall times."""
    rows, times = [], []
    for line in metrics_path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        times.append(float(rec.get("time/step_s", math.nan)))
        rows.append({k: v for k, v in rec.items() if not k.startswith(STEP_METRICS_DROPPED)})
    return rows, times


def _sidecar(var_dir: Path, protocol: Protocol, env: str, mode: str, seed: int) -> Path:
    return Path(var_dir) / "units" / protocol.hash / env / f"{mode}-seed{seed}.json"


@contextmanager
def cell_lock(
    var_dir: Path, out: Path, protocol: Protocol, env: str, mode: str, seed: int
) -> Iterator[None]:
    """Hold the inter-process locks of one cell (`evaluator.locks.lock_if_free`, the holder's
    pid in the lock file): on its run's record under ``var_dir`` and on its result file under
    ``out`` (``.<mode>-seed<K>.json.lock``, hidden: the aggregate passes it over), so processes
    with different var folders writing one results folder are refused too. ValueError naming
    the cell and the holder when another process holds either: two processes training one cell
    would resume one run and write one state, one metrics.jsonl and one cell file."""
    with ExitStack() as stack:
        for target in (
            _sidecar(var_dir, protocol, env, mode, seed),
            cell_path(out, env, mode, seed),
        ):
            if not stack.enter_context(lock_if_free(target, record_holder=True)):
                raise ValueError(
                    f"cell {env}/{mode}-seed{seed} is being trained by another casi process "
                    f"({holder_text(target)}): "
                    "let it finish, or stop it and run this again to resume the cell"
                )
        yield


def _open_or_resume(
    factory: sessionmaker[Session],
    var_dir: Path,
    protocol: Protocol,
    env: Environment,
    mode: str,
    seed: int,
    cfg: TrainConfig,
    policy: LoadedPolicy,
    start: Start,
    max_docs: int | None,
) -> tuple[RunHandle, dict[str, Any], list[dict[str, Any]]]:
    """The cell's training run (resumed when its record exists), the compute spent so far and
    the learning-curve points made so far (up to the step it resumes from: later ones are made
    again)."""
    side = _sidecar(var_dir, protocol, env.name, mode, seed)
    earlier: dict[str, Any] = {"wall_s": 0.0, "machines": []}
    if not side.is_file():
        meta = {"policy": start.version, "start_version": start.version, "evaluator": "replay",
                "max_docs": max_docs, "protocol": protocol.hash, "cell": [env.name, mode, seed]}  # fmt: skip
        handle = open_run(
            factory, var_dir, cfg, policy, f"{protocol.name}-{env.name}-{mode}-s{seed}", meta
        )
        write_json(side, {"run_id": handle.run_id, "compute": earlier})
        return handle, earlier, []
    stored = json.loads(side.read_text())
    handle, stored_cfg, meta = resume_run(factory, var_dir, int(stored["run_id"]))
    if meta.get("start_version") != start.version:
        raise ValueError(
            f"cell {env.name}/{mode}-seed{seed} started from policy {meta.get('start_version')}, "
            f"but the protocol's start is now {start.version}: refusing to resume from another start"
        )
    if stored_cfg.to_dict() != cfg.to_dict():
        raise ValueError(f"cell {env.name}/{mode}-seed{seed}: its stored run has other settings")
    curve = [p for p in stored.get("curve", []) if p["step"] <= handle.start_step]
    return handle, stored.get("compute", earlier), curve


def start_restorer(policy: LoadedPolicy, start: Start) -> Callable[[], None]:
    """``restore`` for :func:`run_cell`: puts the start's weights (copied now) back into the one
    loaded policy that every cell of a command trains; RuntimeError when they come back other."""
    weights = {k: v.clone() for k, v in policy.model.state_dict().items()}

    def restore() -> None:
        policy.model.load_state_dict(weights)
        if policy_version(policy.model) != start.version:
            raise RuntimeError("the start weights did not come back intact")

    return restore


def run_cell(
    factory: sessionmaker[Session],
    var_dir: Path,
    out: Path,
    protocol: Protocol,
    env: Environment,
    mode: str,
    seed: int,
    *,
    retrieval: Any,
    scorer: Any,
    policy: LoadedPolicy,
    start: Start,
    request: EvalRequest,
    pin: dict[str, Any],
    list_k: int,
    restore: Callable[[], None],
    on_step: Callable[[Any], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
    curve: EvalRequest | None = None,
) -> tuple[Path, bool]:
    """Train and evaluate one cell, resuming a killed one; (its file, whether it ran now).
    The cell's lock (:func:`cell_lock`) is held throughout: a cell another process is training
    is refused.

    ``restore()`` puts the start's weights back into ``policy.model`` (cells share one load).
    ``curve``: the learning curve's request (the protocol's ``curve_split`` and queries), which
    the protocol's :attr:`~app.experiments.protocol.Protocol.curve` asks for; None: no curve.
    """
    if (curve is None) != (protocol.curve is None):
        raise ValueError(
            f"protocol {protocol.name} {'asks for' if protocol.curve else 'has'} no learning "
            f"curve, and the cell was {'not ' if curve is None else ''}given its request"
        )
    path = cell_path(out, env.name, mode, seed)
    if path.is_file():
        _check_protocol(read_result(path), protocol, path)
        return path, False
    if mode not in env.modes:
        raise ValueError(f"mode {mode!r} is not in environment {env.name!r} ({list(env.modes)})")
    with cell_lock(var_dir, out, protocol, env.name, mode, seed):
        if path.is_file():  # finished by the process that held the lock a moment ago
            _check_protocol(read_result(path), protocol, path)
            return path, False
        t0 = time.perf_counter()
        cfg = protocol.train_config(env, mode, seed, list_k)
        run_cfg = cfg  # the cell's config, and for a curve its held-out evaluation's schedule
        if curve is not None and protocol.curve is not None:
            run_cfg = dataclasses.replace(cfg, eval=HeldOutConfig(
                every=protocol.curve["every"], queries=len(curve.queries), split=curve.split,
            ))  # fmt: skip
        restore()
        handle, earlier, points = _open_or_resume(
            factory, var_dir, protocol, env, mode, seed, run_cfg, policy, start, retrieval.max_docs
        )
        side = _sidecar(var_dir, protocol, env.name, mode, seed)
        handle.skip_start_eval = True
        if on_phase is not None:
            on_phase(f"training {cfg.steps - handle.start_step} steps (run {handle.run_id})")
        machines = list(earlier.get("machines", []))
        if machine_info() not in machines:
            machines.append(machine_info())

        def keep() -> None:  # the wall time and the curve so far survive a kill
            so_far = float(earlier.get("wall_s", 0.0)) + time.perf_counter() - t0
            write_json(side, {"run_id": handle.run_id, "compute": {"wall_s": so_far, "machines": machines},
                              **({"curve": points} if curve is not None else {})})  # fmt: skip

        def stepped(result: Any) -> None:
            keep()
            if on_step is not None:
                on_step(result)

        def evaluated(step: int, result: EvalResult) -> None:
            points[:] = [p for p in points if p["step"] < step] + [
                curve_point(step, result.metrics)
            ]
            keep()

        trainer = run_training(
            factory, retrieval, scorer, policy, run_cfg, handle, curve, on_step=stepped,
            on_eval=evaluated,
        )  # fmt: skip
        t_train = time.perf_counter() - t0
        pv_id = checkpoint_run(factory, handle, policy, cfg, trainer, cfg.steps)
        if on_phase is not None:
            on_phase(f"evaluating {len(request.queries)} {request.split} claims (greedy float32)")
        t1 = time.perf_counter()
        result = evaluate_and_store(
            factory, trainer.model, policy.tokenizer, request, policy_version_id=pv_id,
            run_id=handle.run_id, step=cfg.steps,
        )  # fmt: skip
        steps, step_s = _step_rows(handle.metrics_path)
        final_version = handle.last_checkpoint[0] if handle.last_checkpoint else start.version
        now = time.perf_counter()
        write_json(path, {
            "format": CELL_FORMAT, "protocol": {"name": protocol.name, "hash": protocol.hash},
            "environment": env.name, "mode": mode, "seed": seed,
            "start": start.pin(),
            "final_version": final_version, "config": cfg.to_dict(), "pins": pin,
            **_eval_rows(result), "steps": steps,
            **({"curve": points} if curve is not None else {}),
            "compute": {
                "wall_s": round(float(earlier.get("wall_s", 0.0)) + now - t0, 1),
                "train_s": round(t_train, 1), "eval_s": round(now - t1, 1),
                "step_s": [round(s, 2) for s in step_s], "resumed_at": handle.start_step,
                "rollouts": cfg.steps * cfg.queries * cfg.samples, "machines": machines,
            },
        })  # fmt: skip
    return path, True
