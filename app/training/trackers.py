"""Experiment trackers for training runs (`--report-to`, after TRL's ``report_to``): read
:func:`open_trackers`, then :class:`Trackers`.

A tracker gets what a run records, at the one place it records it (`app.training.train`'s
writer): the run's stored config once, flattened, as hyperparameters (:func:`flat_params`);
each step's metrics (the dict that goes to the database and ``metrics.jsonl``: reward, gain,
KL, clip and mask fractions, well-formed, credit and shaping statistics, step time per phase)
at that step; each held-out evaluation as ``eval/<split>/<metric>`` at its step. The database
and ``metrics.jsonl`` stay the record: a tracker that raises is warned about once, closed and
dropped, and training goes on (:class:`Trackers`). The built-ins write a file where they will
write before they open (:func:`probe_folder`, :func:`probe_sqlite`), so an unwritable folder or
store is that one warning at once — not MLflow's ~100 s retry loop, nor a TensorBoard writer
thread's traceback (those threads' errors reach the warning through the writer instead).

Extension by name, as the scorer and retriever registries: ``@register_tracker("name",
requires=("module",))`` on a builder ``TrackerSpec → Tracker``. A duplicate name raises
ValueError; an unknown name lists the valid ones; a package that cannot be imported is a
:class:`TrackerUnavailable` naming the ``trackers`` extra (:func:`check_trackers`, which the CLI
calls before anything loads). The built-ins import their package inside the builder only:

| name | writes |
| --- | --- |
| ``tensorboard`` | event files in ``<var>/runs/<id>/tensorboard/`` |
| ``mlflow`` | a local MLflow store, ``<var>/mlruns/mlflow.db`` (SQLite) + ``artifacts/`` |
| ``wandb`` | ``<var>/wandb/``, offline unless ``WANDB_MODE`` says otherwise |
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)

EXTRA_HINT = "pip install -e '.[trackers]'"
NONE = "none"
"""``--report-to none``: no tracker (the default)."""
Status = Literal["finished", "failed"]


class Tracker(Protocol):
    """What a tracker does; any method may raise (the fan-out drops the tracker then)."""

    def log_params(self, params: Mapping[str, str | int | float | bool]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self, status: Status) -> None: ...


@dataclass(frozen=True)
class TrackerSpec:
    """Everything a tracker builder may need about the run it reports."""

    run_id: int
    name: str  # the run's name
    folder: Path  # the run's folder, <var>/runs/<id>
    var_dir: Path
    start_step: int  # a resumed run starts after it (its later steps are recomputed)
    group: str | None  # the experiment a run belongs to (None: a plain `casi train` run)


@dataclass(frozen=True)
class ReportTo:
    """What the command asked for: checked tracker names, where files go, the group."""

    names: tuple[str, ...]
    var_dir: Path
    group: str | None = None


TrackerBuilder = Callable[[TrackerSpec], Tracker]


@dataclass(frozen=True)
class _Entry:
    builder: TrackerBuilder
    requires: tuple[str, ...]  # modules that must import (each named after its pip package)


_REGISTRY: dict[str, _Entry] = {}


def register_tracker(
    name: str, *, requires: tuple[str, ...] = ()
) -> Callable[[TrackerBuilder], TrackerBuilder]:
    """Decorator registering a builder under ``name``; a duplicate name (or ``none``) raises."""

    def decorate(builder: TrackerBuilder) -> TrackerBuilder:
        if name in _REGISTRY or name == NONE:
            raise ValueError(f"tracker {name!r} is already registered")
        _REGISTRY[name] = _Entry(builder, requires)
        return builder

    return decorate


def unregister_tracker(name: str) -> None:
    """Remove a tracker (for tests that register throw-away trackers)."""
    _REGISTRY.pop(name, None)


def registered_trackers() -> tuple[str, ...]:
    """Sorted names of the registered trackers."""
    return tuple(sorted(_REGISTRY))


class TrackerUnavailable(ValueError):
    """A tracker's package cannot be imported."""


TELEMETRY_OFF = {"MLFLOW_DISABLE_TELEMETRY": "true"}
"""MLflow 3 sends usage data to its telemetry server unless told not to; CASI's trackers stay
off the network unless the user's environment says otherwise (a value set there wins)."""


def _quiet_telemetry() -> None:
    for key, value in TELEMETRY_OFF.items():
        os.environ.setdefault(key, value)


def check_trackers(asked: Iterable[str]) -> tuple[str, ...]:
    """The trackers ``--report-to`` names (repeatable or comma-separated; ``none`` alone = no
    tracker), each registered and importable; ValueError otherwise, one line saying the fix."""
    names: list[str] = []
    for part in (p.strip().lower() for a in asked for p in a.split(",")):
        if part and part not in names:
            names.append(part)
    if NONE in names:
        if len(names) > 1:
            raise ValueError(f"--report-to none cannot go with trackers ({', '.join(names)})")
        return ()
    valid = ", ".join((NONE, *registered_trackers()))
    for name in names:
        if name not in _REGISTRY:
            raise ValueError(f"unknown tracker {name!r} for --report-to; valid: {valid}")
        for module in _REGISTRY[name].requires:
            try:
                _quiet_telemetry()
                importlib.import_module(module)
            except ImportError as exc:
                raise TrackerUnavailable(
                    f"--report-to {name} needs the {module} package, which cannot be imported "
                    f"({exc}): {EXTRA_HINT}"
                ) from None
    return tuple(names)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """A nested config as ``a.b.c → value``: lists as JSON, None as ``"none"``."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{name}."))
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        elif value is None:
            out[name] = NONE
        else:
            out[name] = json.dumps(value, default=str)
    return out


class Trackers:
    """The trackers of one run, fed together. A tracker that raises is warned about once
    (logging, so the CLI prints one ``warning:`` line), closed as failed and dropped."""

    def __init__(self, active: dict[str, Tracker], run_id: int) -> None:
        self.active, self.run_id = active, run_id

    def log_params(self, params: Mapping[str, str | int | float | bool]) -> None:
        self._each("logging the config", lambda t: t.log_params(params))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._each(f"logging step {step}", lambda t: t.log_metrics(metrics, step))

    def close(self, status: Status = "finished") -> None:
        self._each("closing", lambda t: t.close(status))
        self.active.clear()

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for name, tracker in list(self.active.items()):
            try:
                call(tracker)
            except Exception as exc:  # a tracker never stops training
                del self.active[name]
                _warn(name, what, self.run_id, exc)
                with contextlib.suppress(Exception):
                    tracker.close("failed")


MAX_CAUSES = 8  # how deep the warning looks for the root of an exception's chain


def _warn(name: str, what: str, run_id: int, exc: BaseException) -> None:
    """One line; the reason is the root of the exception's chain (MLflow wraps SQLAlchemy,
    which wraps the database's own error, the one that says what is wrong)."""
    for _ in range(MAX_CAUSES):
        if exc.__cause__ is None:
            break
        exc = exc.__cause__
    reason = str(exc).strip()
    log.warning(
        "tracker %s failed %s (%s: %s); it is off for the rest of run %d, whose records in the "
        "database and metrics.jsonl are complete",
        name, what, type(exc).__name__, reason.splitlines()[0] if reason else "", run_id,
    )  # fmt: skip


def open_trackers(report: ReportTo | None, spec: TrackerSpec) -> Trackers:
    """The asked trackers, opened for the run of ``spec``; one that fails to open is warned
    about and left out (the run trains and records all the same)."""
    active: dict[str, Tracker] = {}
    for name in report.names if report is not None else ():
        try:
            active[name] = _REGISTRY[name].builder(spec)
        except Exception as exc:
            _warn(name, "opening", spec.run_id, exc)
    return Trackers(active, spec.run_id)


# --- the built-ins ---------------------------------------------------------------------------


def probe_folder(folder: Path) -> None:
    """Create ``folder`` and a file in it, then remove the file: an unwritable folder is an
    OSError naming it now, when the tracker opens (one warning), not a writer thread's
    traceback or a store's retry loop later."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".casi-probe-", dir=folder)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(folder)) from None
    os.close(fd)
    os.unlink(name)


def _quiet_writer_threads() -> None:
    """TensorBoard's writer thread keeps the error it dies of and re-raises it, so Python's
    thread hook prints its traceback (~40 lines) although the writer raises the same error
    again in the main thread at the next write or flush — where the fan-out turns it into its
    one warning. Such threads are left to that path; any other thread is reported as before."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another layout: its threads are reported as Python reports them
        return
    previous = threading.excepthook
    if getattr(previous, "casi_quiet_tensorboard", False):
        return

    def hook(args: Any) -> None:
        thread = args.thread
        if isinstance(thread, _AsyncWriterThread) and thread.exception is args.exc_value:
            return
        previous(args)

    hook.casi_quiet_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


@register_tracker("tensorboard", requires=("tensorboard",))
def _tensorboard(spec: TrackerSpec) -> Tracker:
    from torch.utils.tensorboard import SummaryWriter

    folder = spec.folder / "tensorboard"
    probe_folder(folder)
    _quiet_writer_threads()
    # a resumed run rewrites the steps after its saved state: TensorBoard drops the old ones
    purge = spec.start_step + 1 if spec.start_step else 0
    again = folder.is_dir() and any(folder.iterdir())
    return _TensorBoard(SummaryWriter(str(folder), purge_step=purge if again else None))


class _TensorBoard:
    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log_params(self, params: Mapping[str, str | int | float | bool]) -> None:
        from torch.utils.tensorboard import summary

        hparams: Any = summary.hparams  # the hparams plugin's three summaries, in this run
        for part in hparams(dict(params), {}):
            self.writer.file_writer.add_summary(part)
        table = "\n".join(f"    {k} = {v}" for k, v in params.items())
        self.writer.add_text("config", table)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, status: Status) -> None:
        self.writer.close()


MLFLOW_EXPERIMENT = "casi"
SQLITE_LOCK_WAIT_S = 10.0  # another run writing the same store holds the lock for milliseconds
MLFLOW_BATCH = 100  # params per log_batch call (MLflow's limit)
_MLFLOW_NAME = re.compile(r"[^\w\-. :/]")  # MLflow's allowed name characters, complemented


MLFLOW_DB = "mlflow.db"


def mlflow_uri(var_dir: Path) -> str:
    """The local MLflow store under ``var_dir`` (SQLite: MLflow's file store is deprecated)."""
    return f"sqlite:///{(var_dir / 'mlruns' / MLFLOW_DB).resolve().as_posix()}"


def probe_sqlite(path: Path) -> None:
    """The store's database opens and takes a write lock (created empty when absent, as MLflow
    would). MLflow retries a database it cannot open nine times with backoff, ~100 s of
    warnings, before it gives up; this fails at once, naming the file."""
    import sqlite3

    try:
        conn = sqlite3.connect(path, timeout=SQLITE_LOCK_WAIT_S, isolation_level=None)
        try:  # a write, rolled back: a read-only file (or folder) fails here, not at BEGIN
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("CREATE TABLE casi_write_probe (x)")
            conn.execute("ROLLBACK")
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise OSError(f"cannot write the MLflow store {path}: {exc}") from None


def mlflow_key(key: str) -> str:
    """``combined_ndcg@10`` → ``combined_ndcg_at_10``: MLflow names allow no ``@``."""
    return _MLFLOW_NAME.sub("_", key.replace("@", "_at_"))


@register_tracker("mlflow", requires=("mlflow",))
def _mlflow(spec: TrackerSpec) -> Tracker:
    _quiet_telemetry()
    from mlflow.tracking import MlflowClient

    # its store logs each failure at length (retry warnings, tracebacks) before raising it: the
    # fan-out's one warning says it, once
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    root = spec.var_dir / "mlruns"
    probe_folder(root)
    probe_sqlite(root / MLFLOW_DB)
    client = MlflowClient(tracking_uri=mlflow_uri(spec.var_dir))
    name = MLFLOW_EXPERIMENT if spec.group is None else f"{MLFLOW_EXPERIMENT}/{spec.group}"
    found = client.get_experiment_by_name(name)
    experiment = (
        found.experiment_id
        if found is not None
        else client.create_experiment(
            name, artifact_location=(root / "artifacts").resolve().as_uri()
        )
    )
    marker = spec.folder / "mlflow_run_id"  # a resumed run reports to the same MLflow run
    run_id = marker.read_text().strip() if marker.is_file() else ""
    if run_id:
        client.update_run(run_id, status="RUNNING")
    else:
        tags = {"casi.run_id": str(spec.run_id), "casi.folder": str(spec.folder)}
        run_id = client.create_run(experiment, run_name=spec.name, tags=tags).info.run_id
        marker.write_text(run_id)
    return _MLflow(client, run_id)


class _MLflow:
    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log_params(self, params: Mapping[str, str | int | float | bool]) -> None:
        from mlflow.entities import Param

        items = [Param(mlflow_key(k), str(v)) for k, v in params.items()]
        for i in range(0, len(items), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + MLFLOW_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=items)

    def close(self, status: Status) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if status == "finished" else "FAILED")


WANDB_PROJECT = "casi"


@register_tracker("wandb", requires=("wandb",))
def _wandb(spec: TrackerSpec) -> Tracker:
    import wandb

    options: dict[str, Any] = {
        "project": WANDB_PROJECT, "name": f"{spec.name} (run {spec.run_id})",
        "group": spec.group, "dir": str(spec.var_dir), "tags": [f"casi-run-{spec.run_id}"],
        "settings": wandb.Settings(silent=True, console="off"),
        # never the network unless the user asks: offline, or the user's WANDB_MODE (passed
        # here, as W&B reads the environment once per process)
        "mode": os.environ.get("WANDB_MODE", "").strip() or "offline",
    }  # fmt: skip
    run = wandb.init(**options)
    return _WandB(run)


class _WandB:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log_params(self, params: Mapping[str, str | int | float | bool]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, status: Status) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)
