"""`--report-to` (app/training/trackers.py): a run's records reach its trackers.

`casi train --report-to tensorboard --report-to mlflow` on the tiny format policy and the SciFact
slice: TensorBoard's own reader reads back every step metric and held-out number the run stored
in the database, and the MLflow client reads the same numbers and the run's config from the
local store. A tracker registered here that raises mid-run is warned about once and dropped; the
run finishes with every step in the database and metrics.jsonl. A tracker whose package cannot
be imported is one `error:` line naming the extra. W&B runs offline unless WANDB_MODE says
otherwise. Real model, real Redis, real SQLite; nothing of the training is mocked.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from app.cli import app
from app.db.models import Evaluation, StepMetric, TrainingRun
from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.settings import get_settings
from app.training import trackers as tr
from app.training.policy_loader import LoadedPolicy
from app.training.runs import open_run
from app.training.train import run_training
from policy.model import policy_version, save_checkpoint
from policy.train_config import TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hardening"))
from hardening_support import read_only  # noqa: E402

TRAIN = ["--steps", "2", "--queries", "2", "--samples", "3", "--n-actions", "2", "--line-cap",
         "10", "--lr", "1e-3", "--no-anchor", "--eval-every", "2", "--eval-queries", "2",
         "--micro-batch-size", "4"]  # fmt: skip
TB_ATOL = 1e-6  # TensorBoard stores scalars as float32


@pytest.fixture
def cli_env(slice_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """`casi` in this process on the slice (BM25 actions: no dense index to build), a fresh var
    dir, SQLite and the embedded Redis; yields the var dir."""
    var = tmp_path / "var"
    env = {"CASI_VAR_DIR": str(var), "CASI_DATASET": str(slice_path), "CASI_RETRIEVER": "bm25",
           "CASI_BM25_STEMMER": "none", "CASI_DEVICE": "cpu", "CASI_THREADS": "1"}  # fmt: skip
    for name in ("DATABASE_URL", "REDIS_URL", "CASI_MAX_DOCS", "CASI_MERGE", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield var
    get_settings.cache_clear()


def _stored(db: Path, run_id: int) -> tuple[TrainingRun, list[StepMetric], list[Evaluation]]:
    engine = make_engine(f"sqlite:///{db.as_posix()}")
    try:
        with make_session_factory(engine)() as session:
            run = session.get(TrainingRun, run_id)
            steps = session.scalars(
                select(StepMetric).where(StepMetric.run_id == run_id).order_by(StepMetric.step)
            ).all()
            evals = session.scalars(
                select(Evaluation).where(Evaluation.run_id == run_id).order_by(Evaluation.step)
            ).all()
            assert run is not None
            session.expunge_all()
            return run, list(steps), list(evals)
    finally:
        engine.dispose()


def _expected(steps: list[StepMetric], evals: list[Evaluation]) -> dict[str, dict[int, float]]:
    """Every number the run recorded, as tag → {step: value} (evaluations as eval/<split>/…)."""
    out: dict[str, dict[int, float]] = {}
    for row in steps:
        for key, value in row.metrics.items():
            out.setdefault(key, {})[row.step] = float(value)
    for e in evals:
        for key, value in e.metrics.items():
            out.setdefault(f"eval/{e.split}/{key}", {})[e.step] = float(value)
    return out


@pytest.mark.integration
def test_tensorboard_and_mlflow_read_back_what_the_run_recorded(
    format_policy: Any, smol_tokenizer: Any, cli_env: Path, tmp_path: Path
) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = save_checkpoint(format_policy, smol_tokenizer, tmp_path / "policy")
    args = ["train", "--policy", str(folder), *TRAIN, "--name", "tracked",
            "--report-to", "tensorboard", "--report-to", "mlflow"]  # fmt: skip
    done = CliRunner().invoke(app, args, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    run, steps, evals = _stored(cli_env / "casi.db", 1)
    assert run.status == "finished" and [s.step for s in steps] == [1, 2]
    assert [e.step for e in evals] == [0, 2]
    expected = _expected(steps, evals)
    assert {"reward_mean", "gain_mean", "format_ok_fraction", "time/step_s"} <= set(expected)
    assert "eval/test/combined_ndcg@10" in expected

    events = EventAccumulator(
        str(cli_env / "runs" / "1" / "tensorboard"), size_guidance={"scalars": 0}
    )
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, by_step in expected.items():
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert got.keys() == by_step.keys(), tag
        for step, value in by_step.items():
            assert got[step] == pytest.approx(value, rel=TB_ATOL, abs=TB_ATOL), (tag, step)
    assert "config/text_summary" in events.Tags()["tensors"]

    client = MlflowClient(tracking_uri=tr.mlflow_uri(cli_env))
    run_id = (cli_env / "runs" / "1" / "mlflow_run_id").read_text().strip()
    ml = client.get_run(run_id)
    assert ml.info.status == "FINISHED" and ml.info.run_name == "tracked"
    assert ml.data.tags["casi.run_id"] == "1"
    assert client.get_experiment(ml.info.experiment_id).name == "casi"
    params = ml.data.params
    assert params["train.steps"] == "2" and params["train.samples"] == "3"
    assert params["train.rollout.n_actions"] == "2" and params["evaluator"] == "replay"
    assert params["retrieval.retriever"] == "bm25"
    for tag, by_step in expected.items():
        history = client.get_metric_history(run_id, tr.mlflow_key(tag))
        assert {m.step: m.value for m in history} == pytest.approx(by_step, abs=1e-12), tag


class _Notebook:
    """A tracker that keeps what it is given."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.steps: list[int] = []
        self.closed: list[str] = []

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.params.update(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.steps.append(step)

    def close(self, status: str) -> None:
        self.closed.append(status)


class _Breaks(_Notebook):
    """Raises at step 2."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        super().log_metrics(metrics, step)
        if step == 2:
            raise OSError("disk full")


@pytest.fixture
def registered() -> Iterator[dict[str, _Notebook]]:
    made: dict[str, _Notebook] = {}
    for name, cls in (("notebook", _Notebook), ("breaks", _Breaks)):
        tr.register_tracker(name)(lambda spec, name=name, cls=cls: made.setdefault(name, cls()))
    yield made
    for name in ("notebook", "breaks"):
        tr.unregister_tracker(name)


@pytest.mark.integration
def test_a_tracker_that_raises_mid_run_is_dropped_and_the_run_records_everything(
    format_policy: Any,
    smol_tokenizer: Any,
    slice_retrieval: Any,
    train_scorer: Any,
    registered: dict[str, _Notebook],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"sqlite:///{(tmp_path / 'casi.db').as_posix()}"
    upgrade_to_head(url)
    factory = make_session_factory(make_engine(url))
    cfg = TrainConfig.from_preset(
        "casi", steps=3, queries=2, samples=2, n_actions=2, line_cap=10, lr=1e-3,
        anchor_query=False, eval_queries=0, micro_batch_size=4,
    )  # fmt: skip
    model = copy.deepcopy(format_policy)
    pol = LoadedPolicy(
        model, smol_tokenizer, policy_version(model), "format", "tiny", "tiny", "base"
    )
    meta = {"policy": None, "evaluator": "replay", "max_docs": None}
    handle = open_run(factory, tmp_path, cfg, pol, "breaks", meta)
    report = tr.ReportTo(tr.check_trackers(["breaks,notebook"]), tmp_path)
    with caplog.at_level(logging.WARNING, logger="app.training.trackers"):
        trainer = run_training(
            factory, slice_retrieval, train_scorer, pol, cfg, handle, None, report_to=report
        )
    assert trainer.step == 3
    warnings = [r for r in caplog.records if r.name == "app.training.trackers"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "breaks" in warnings[0].getMessage() and "disk full" in warnings[0].getMessage()
    broke, kept = registered["breaks"], registered["notebook"]
    assert broke.steps == [1, 2] and broke.closed == ["failed"]  # never called after it raised
    assert kept.steps == [1, 2, 3] and kept.closed == ["finished"]
    assert kept.params["train.steps"] == 3 and kept.params["policy"] == "none"
    run, steps, _ = _stored(tmp_path / "casi.db", handle.run_id)
    assert run.status == "finished" and [s.step for s in steps] == [1, 2, 3]
    lines = [json.loads(x) for x in handle.metrics_path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow", "wandb"])
def test_a_missing_package_is_one_clear_error(
    tracker: str, cli_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """casi train checks the tracker's package before anything loads. (A protocol's cells,
    `casi experiment credit`, take no --report-to: the protocol fixes every setting.)"""
    monkeypatch.setitem(sys.modules, tracker, None)  # `import <tracker>` fails, as uninstalled
    done = CliRunner().invoke(app, ["train", "--report-to", tracker])
    assert done.exit_code == 2, done.output
    line = " ".join(done.output.split())
    assert line.startswith(f"error: --report-to {tracker} needs the {tracker} package")
    assert line.endswith("pip install -e '.[trackers]'")
    assert not (cli_env / "casi.db").exists()  # refused before anything was opened


def test_report_to_names_are_checked() -> None:
    assert tr.check_trackers([]) == () and tr.check_trackers(["none"]) == ()
    assert "tensorboard" in tr.registered_trackers() and "mlflow" in tr.registered_trackers()
    with pytest.raises(ValueError, match="unknown tracker 'tensorbored'.*valid: none, "):
        tr.check_trackers(["tensorbored"])
    with pytest.raises(ValueError, match="none cannot go with"):
        tr.check_trackers(["none", "mlflow"])
    with pytest.raises(ValueError, match="already registered"):
        tr.register_tracker("tensorboard")(lambda spec: _Notebook())
    assert tr.flat_params({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": True}) == {
        "a.b": 1, "a.c": "[1, 2]", "d": "none", "e": True,
    }  # fmt: skip
    assert tr.mlflow_key("eval/test/combined_ndcg@10") == "eval/test/combined_ndcg_at_10"


@pytest.mark.parametrize("mode", [None, "disabled"])
def test_wandb_is_offline_unless_wandb_mode_says_otherwise(
    mode: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    if mode is not None:
        monkeypatch.setenv("WANDB_MODE", mode)
    folder = tmp_path / "runs" / "7"
    folder.mkdir(parents=True)
    spec = tr.TrackerSpec(7, "w", folder, tmp_path, 0, None)
    trackers = tr.open_trackers(tr.ReportTo(("wandb",), tmp_path), spec)
    assert list(trackers.active) == ["wandb"]
    trackers.log_params({"train.steps": 2})
    trackers.log_metrics({"reward_mean": 0.5}, 1)
    trackers.close()
    assert list(trackers.active) == []
    offline = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    if mode is None:  # offline by default: the run's records are on disk, for `wandb sync`
        assert len(offline) == 1 and offline[0].stat().st_size > 0
    else:  # the user's mode wins (disabled: nothing written)
        assert offline == []


@pytest.mark.parametrize("given", [None, "false"])
def test_mlflow_telemetry_is_off_unless_the_environment_says_otherwise(
    given: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.delenv("DO_NOT_TRACK", raising=False)
    if given is None:
        monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", given)
    assert tr.check_trackers(["mlflow"]) == ("mlflow",)  # imports mlflow: telemetry already off
    import os

    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == (given or "true")


FAIL_FAST_S = 5.0
"""A broken tracker costs no step time: MLflow's retry loop on a store it could not open took
0.1 + 0.3 + … + 51.1 s ≈ 102 s before it gave up (its first five waits alone are 2.6 s)."""


def _tracker_warnings(caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    """tracker name → its warning; fails on a second warning for the same tracker."""
    out: dict[str, str] = {}
    for record in caplog.records:
        if record.name == "app.training.trackers" and record.levelno >= logging.WARNING:
            name = record.getMessage().split()[1]
            assert name not in out, record.getMessage()
            out[name] = record.getMessage()
    return out


def _no_thread_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    time.sleep(0.5)  # a writer thread that died prints (printed) its traceback from that thread
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err


def test_unwritable_tracker_folders_are_one_warning_each_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 38, item 13: an unwritable TensorBoard folder gave the warning and then ~40 lines
    of its writer thread's PermissionError traceback; an unwritable MLflow store printed nine
    "retried in … seconds" blocks and held the run ~100 s. Each is now one warning, at once,
    and the run's later steps call no broken tracker."""
    tr.check_trackers(["tensorboard", "mlflow"])  # imports both: not timed below
    folder = tmp_path / "runs" / "1"
    (folder / "tensorboard").mkdir(parents=True)
    (tmp_path / "mlruns").mkdir()
    spec = tr.TrackerSpec(1, "ro", folder, tmp_path, 0, None)
    with read_only(folder / "tensorboard"), read_only(tmp_path / "mlruns"):
        with caplog.at_level(logging.WARNING):
            t0 = time.perf_counter()
            trackers = tr.open_trackers(tr.ReportTo(("tensorboard", "mlflow"), tmp_path), spec)
            opened_s = time.perf_counter() - t0
            trackers.log_params({"train.steps": 3})
            for step in (1, 2, 3):
                trackers.log_metrics({"reward_mean": 0.5}, step)
            trackers.close()
    assert opened_s < FAIL_FAST_S and trackers.active == {}
    warned = _tracker_warnings(caplog)
    assert set(warned) == {"tensorboard", "mlflow"}
    assert (
        f"{folder / 'tensorboard'}" in warned["tensorboard"]
        and "failed opening" in warned["tensorboard"]
    )
    assert f"{tmp_path / 'mlruns'}" in warned["mlflow"] and "failed opening" in warned["mlflow"]
    assert not [
        r for r in caplog.records if r.name.startswith("mlflow") and r.levelno >= logging.WARNING
    ]
    _no_thread_traceback(capfd)


def test_trackers_whose_files_turn_read_only_mid_run_are_one_warning_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Item 13, mid-run: TensorBoard's writer thread dies of the error (its traceback was
    printed by Python's thread hook); MLflow's store logged the error at length. One warning
    each, naming the root cause, and the step that met it is not held up."""
    tr.check_trackers(["tensorboard", "mlflow"])
    folder = tmp_path / "runs" / "1"
    folder.mkdir(parents=True)
    spec = tr.TrackerSpec(1, "mid", folder, tmp_path, 0, None)
    trackers = tr.open_trackers(tr.ReportTo(("tensorboard", "mlflow"), tmp_path), spec)
    trackers.log_params({"train.steps": 3})
    trackers.log_metrics({"reward_mean": 0.5}, 1)
    assert list(trackers.active) == ["tensorboard", "mlflow"]
    (event_file,) = (folder / "tensorboard").glob("events.out.tfevents.*")
    with ExitStack() as stack, caplog.at_level(logging.WARNING):
        for path in (event_file, folder / "tensorboard", tmp_path / "mlruns" / tr.MLFLOW_DB, tmp_path / "mlruns"):  # fmt: skip
            stack.enter_context(read_only(path))
        t0 = time.perf_counter()
        trackers.log_metrics({"reward_mean": 0.25}, 2)
        step_s = time.perf_counter() - t0
        trackers.log_metrics({"reward_mean": 0.125}, 3)
        trackers.close()
    assert step_s < FAIL_FAST_S and trackers.active == {}
    warned = _tracker_warnings(caplog)
    assert set(warned) == {"tensorboard", "mlflow"}
    assert "failed logging step 2 (PermissionError" in warned["tensorboard"]
    assert "failed logging step 2 (OperationalError" in warned["mlflow"]
    _no_thread_traceback(capfd)


def test_casi_train_with_read_only_tracker_folders_records_everything(
    format_policy: Any,
    smol_tokenizer: Any,
    cli_env: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Item 13 end to end: `casi train --report-to tensorboard --report-to mlflow` with both
    tracker folders read-only trains and records every step, with one warning per tracker."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    folder = save_checkpoint(format_policy, smol_tokenizer, tmp_path / "policy")
    (cli_env / "runs" / "1" / "tensorboard").mkdir(parents=True)
    (cli_env / "mlruns").mkdir()
    args = ["train", "--policy", str(folder), *TRAIN, "--report-to", "tensorboard",
            "--report-to", "mlflow"]  # fmt: skip
    with read_only(cli_env / "runs" / "1" / "tensorboard"), read_only(cli_env / "mlruns"):
        with caplog.at_level(logging.WARNING):
            done = CliRunner().invoke(app, args, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert set(_tracker_warnings(caplog)) == {"tensorboard", "mlflow"}
    run, steps, evals = _stored(cli_env / "casi.db", 1)
    assert run.status == "finished" and [s.step for s in steps] == [1, 2]
    assert [e.step for e in evals] == [0, 2]
    _no_thread_traceback(capfd)
