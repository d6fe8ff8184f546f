"""`casi train --resume` and a run's integrity, on the tiny policy, the SciFact slice (BM25:
no dense index to build), real SQLite and the embedded Redis:

- a resume trains on the index the run started on (its stored slice, the full corpus included,
  whatever `casi index build` built last or CASI_MAX_DOCS says), and refuses another index;
- a resume scores with the run's CASI_LIST_K, and refuses a KL reference that now resolves to
  other weights;
- a run that is interrupted (Ctrl-C, SIGTERM) ends `cancelled`, one that fails ends `failed`;
- two processes never train one run: the second is refused, naming the holder's pid;
- a torn last line of metrics.jsonl does not block the resume; a bad line elsewhere is named,
  and the database is left as it was;
- `casi eval --split bogus` is refused before any index is built.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from app.cli import app
from app.db.models import StepMetric, TrainingRun
from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.settings import get_settings
from app.training.policy_loader import LoadedPolicy
from app.training.runs import RunHandle, open_run, resume_run
from app.training.train import run_training
from evaluator.locks import lock_path
from policy.model import build_tiny_policy, policy_version, save_checkpoint
from policy.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    bool(os.environ.get("DATABASE_URL")),
    reason="every test runs on SQLite and the embedded Redis whatever DATABASE_URL says (the "
    "environment is cleared): the pass without DATABASE_URL (.ci/run's second) runs them",
)
TRAIN = ["--steps", "1", "--queries", "2", "--samples", "2", "--n-actions", "2", "--line-cap",
         "10", "--lr", "1e-3", "--no-anchor", "--eval-queries", "0", "--micro-batch-size", "4",
         "--seed", "3"]  # fmt: skip
ENV = {"CASI_RETRIEVER": "bm25", "CASI_BM25_STEMMER": "none", "CASI_DEVICE": "cpu",
       "CASI_THREADS": "1"}  # fmt: skip
CLEARED = ("DATABASE_URL", "REDIS_URL", "CASI_MAX_DOCS", "CASI_MERGE", "CASI_LIST_K",
           "CASI_GAME", "CASI_RETRIEVAL_K", "WANDB_MODE")  # fmt: skip


@pytest.fixture
def dataset(slice_path: Path, tmp_path: Path) -> Path:
    """A private copy of the slice (a test changes its corpus)."""
    return Path(shutil.copytree(slice_path, tmp_path / "data"))


@pytest.fixture
def cli_env(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """`casi` in this process on the slice copy, a fresh var dir, SQLite and the embedded
    Redis; yields the environment (for a `casi` subprocess too)."""
    var = tmp_path / "var"
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)
    env = {**ENV, "CASI_VAR_DIR": str(var), "CASI_DATASET": str(dataset)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def tiny_folder(smol_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_tiny_policy(smol_tokenizer, seed=0)
    return save_checkpoint(model, smol_tokenizer, tmp_path_factory.mktemp("tiny") / "policy")


def _casi(*args: str, **env: str) -> Any:
    """`casi ARGS` in this process, with ``env`` set for it only."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(app, list(args), catch_exceptions=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_settings.cache_clear()


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def _one_error(done: Any, *fragments: str) -> str:
    lines = _errors(done.output)
    assert done.exit_code == 2 and len(lines) == 1, done.output
    assert "Traceback" not in done.output, done.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _index_line(output: str) -> str:
    found = re.search(r"index (\w+) \((\d+) docs\)", output.replace("\n", " "))
    assert found is not None, output
    return found.group(0)


def _run(var: Path, run_id: int = 1) -> tuple[str, list[int], dict[str, Any]]:
    """(status, recorded steps, stored config) of run ``run_id``."""
    engine = make_engine(f"sqlite:///{(var / 'casi.db').as_posix()}")
    try:
        with make_session_factory(engine)() as session:
            run = session.get(TrainingRun, run_id)
            assert run is not None
            steps = session.scalars(select(StepMetric.step).where(StepMetric.run_id == run_id))
            return run.status, sorted(steps), dict(run.config)
    finally:
        engine.dispose()


def _jsonl(var: Path, run_id: int = 1) -> list[dict[str, Any]]:
    path = var / "runs" / str(run_id) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _deterministic(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "cache/"))}


# --- finding 2: the run's own index ---------------------------------------------------------


@pytest.mark.integration
def test_resume_trains_on_the_index_the_run_started_on(
    cli_env: dict[str, str], tiny_folder: Path, dataset: Path
) -> None:
    var = Path(cli_env["CASI_VAR_DIR"])
    done = _casi("train", "--policy", str(tiny_folder), *TRAIN)
    assert done.exit_code == 0, done.output
    started = _index_line(done.output)  # the whole corpus: no --max-docs, no slice built
    # neither the slice `casi index build` built last nor CASI_MAX_DOCS moves the resume
    built = _casi("index", "build", "--max-docs", "30")
    assert built.exit_code == 0, built.output
    for env in ({}, {"CASI_MAX_DOCS": "20"}):
        resumed = _casi("train", "--resume", "1", **env)
        assert resumed.exit_code == 0, resumed.output
        assert _index_line(resumed.output) == started, env
    meta = _run(var)[2]  # the run stores its index: its slice, version and size
    assert meta["max_docs"] is None and meta["index_version"] in started
    assert f"({meta['index_docs']} docs)" in started
    # the corpus under the run changed: refused, naming both versions, nothing touched
    before = _run(var)
    with (dataset / "corpus.jsonl").open("a") as fh:
        fh.write(json.dumps({"_id": "extra", "title": "extra", "text": "a new document"}) + "\n")
    refused = _casi("train", "--resume", "1")
    line = _one_error(refused, "run 1 started on index", meta["index_version"], "start a new run")
    assert re.search(r"now build index (\w+)", line).group(1) != meta["index_version"]  # type: ignore[union-attr]
    assert _run(var) == before


# --- findings 8 and 9: the run's list_k and KL reference --------------------------------------


@pytest.mark.integration
def test_resume_scores_with_the_run_s_list_k(cli_env: dict[str, str], tiny_folder: Path) -> None:
    var = Path(cli_env["CASI_VAR_DIR"])
    anchored = ["--anchor" if a == "--no-anchor" else a for a in TRAIN]  # rewards depend on k
    done = _casi("train", "--policy", str(tiny_folder), *anchored)
    assert done.exit_code == 0, done.output
    first = _jsonl(var)
    assert first[0]["reward_mean"] > 0
    assert _run(var)[2]["train"]["list_k"] == 10
    shutil.rmtree(var / "runs" / "1" / "state")  # killed before its first state: redo step 1
    resumed = _casi("train", "--resume", "1", CASI_LIST_K="1")
    assert resumed.exit_code == 0, resumed.output
    again = _jsonl(var)
    assert [r["step"] for r in again] == [1]
    assert _deterministic(again[0]) == _deterministic(first[0])  # nDCG@10 still, not nDCG@1


@pytest.mark.integration
def test_resume_refuses_a_reference_that_resolves_to_other_weights(
    cli_env: dict[str, str], tiny_folder: Path, smol_tokenizer: Any, tmp_path: Path
) -> None:
    var = Path(cli_env["CASI_VAR_DIR"])
    reference = Path(shutil.copytree(tiny_folder, tmp_path / "reference"))
    done = _casi("train", "--policy", str(tiny_folder), "--reference", str(reference), *TRAIN)
    assert done.exit_code == 0, done.output
    pinned = policy_version(build_tiny_policy(smol_tokenizer, seed=0))  # what it resolved to
    assert f"policy {pinned}" in done.output.replace("\n", " ")
    other = build_tiny_policy(smol_tokenizer, seed=1)
    save_checkpoint(other, smol_tokenizer, reference)  # the folder now holds other weights
    before = _run(var)
    refused = _casi("train", "--resume", "1")
    _one_error(refused, "KL reference", pinned, policy_version(other), "start a new run")
    assert _run(var) == before


# --- finding 3: an interrupted or failed run is not left running -------------------------------


def _policy(smol_tokenizer: Any, tiny: Any) -> LoadedPolicy:
    return LoadedPolicy(tiny, smol_tokenizer, policy_version(tiny), "tiny", "tiny", "tiny", "base")


@pytest.mark.integration
def test_an_interrupted_run_ends_cancelled_and_a_failed_one_failed(
    smol_tokenizer: Any, slice_retrieval: Any, train_scorer: Any, tmp_path: Path
) -> None:
    url = f"sqlite:///{(tmp_path / 'casi.db').as_posix()}"
    upgrade_to_head(url)
    engine = make_engine(url)
    factory = make_session_factory(engine)
    cfg = TrainConfig.from_preset(
        "casi", steps=1, queries=2, samples=2, n_actions=2, line_cap=10, anchor_query=False,
        micro_batch_size=4,
    )  # fmt: skip
    tiny = build_tiny_policy(smol_tokenizer, seed=0)
    meta = {"policy": None, "evaluator": "replay", "max_docs": None}

    def status(run_id: int) -> str:
        with factory() as session:
            run = session.get(TrainingRun, run_id)
            assert run is not None
            return run.status

    def interrupt(_result: Any) -> None:
        raise KeyboardInterrupt

    pol = _policy(smol_tokenizer, copy.deepcopy(tiny))
    handle = open_run(factory, tmp_path, cfg, pol, "ctrl-c", meta)
    with pytest.raises(KeyboardInterrupt):
        run_training(factory, slice_retrieval, train_scorer, pol, cfg, handle, None,
                     on_step=interrupt)  # fmt: skip
    assert status(handle.run_id) == "cancelled"
    resumed, _, _ = resume_run(factory, tmp_path, handle.run_id)  # running again, and it ends
    assert status(handle.run_id) == "running"
    run_training(factory, slice_retrieval, train_scorer, pol, cfg, resumed, None)
    assert status(handle.run_id) == "finished"

    pol = _policy(smol_tokenizer, copy.deepcopy(tiny))
    handle = open_run(factory, tmp_path, cfg, pol, "crash", meta)
    handle.metrics_path.mkdir()  # its metrics cannot be written
    with pytest.raises(OSError):
        run_training(factory, slice_retrieval, train_scorer, pol, cfg, handle, None)
    assert status(handle.run_id) == "failed"
    engine.dispose()


# --- finding 7: one process per run ---------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from evaluator.locks import lock_if_free
with lock_if_free(Path(sys.argv[1]), record_holder=True) as free:
    assert free
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.integration
def test_a_second_process_cannot_resume_a_run_being_trained(
    cli_env: dict[str, str], tiny_folder: Path, smol_tokenizer: Any, slice_retrieval: Any,
    train_scorer: Any,
) -> None:  # fmt: skip
    var = Path(cli_env["CASI_VAR_DIR"])
    done = _casi("train", "--policy", str(tiny_folder), *TRAIN)
    assert done.exit_code == 0, done.output
    folder = var / "runs" / "1"
    assert not lock_path(folder / "run").exists()  # let go at the end
    shutil.rmtree(folder / "state")  # a resume would drop step 1 and train it again
    before = _run(var)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder / "run")], cwd=ROOT, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        refused = _casi("train", "--resume", "1")
        _one_error(refused, "run 1 is being trained by another casi process", f"pid {holder.pid}")
        assert _run(var) == before and len(_jsonl(var)) == 1
        # the service refuses too (an experiment's cell, a job): before it drops anything
        factory = make_session_factory(make_engine(f"sqlite:///{(var / 'casi.db').as_posix()}"))
        with pytest.raises(ValueError, match=f"pid {holder.pid}"):
            resume_run(factory, var, 1)
        cfg = TrainConfig.from_dict(before[2]["train"])
        with pytest.raises(ValueError, match=f"pid {holder.pid}"):
            run_training(factory, slice_retrieval, train_scorer,
                         _policy(smol_tokenizer, build_tiny_policy(smol_tokenizer, seed=0)), cfg,
                         RunHandle(1, folder), None)  # fmt: skip
        assert _run(var) == before
    finally:
        holder.kill()
        holder.wait(timeout=30)


@pytest.mark.integration
def test_a_terminated_casi_train_holds_its_run_then_ends_it_cancelled(
    cli_env: dict[str, str], tiny_folder: Path
) -> None:
    """The real command: while it trains, a resume is refused naming its pid; a SIGTERM (an API
    cancel, `kill`) ends its run `cancelled`, not `running`."""
    var = Path(cli_env["CASI_VAR_DIR"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = ["--steps", "50", *TRAIN[2:]]  # still training when it is stopped
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "train", "--policy", str(tiny_folder), *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 300
        lock = lock_path(var / "runs" / "1" / "run")
        while time.time() < deadline and proc.poll() is None:
            if lock.is_file() and lock.read_text().strip() == str(proc.pid):
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0]
        refused = _casi("train", "--resume", "1")
        _one_error(refused, "being trained by another casi process", f"pid {proc.pid}")
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 143 and "terminated (SIGTERM)" in out, out
    assert _run(var)[0] == "cancelled"
    assert not lock.exists()


# --- finding 10: a torn metrics.jsonl --------------------------------------------------------


@pytest.mark.integration
def test_a_torn_last_metrics_line_is_dropped_and_a_bad_one_is_named(
    cli_env: dict[str, str], tiny_folder: Path
) -> None:
    var = Path(cli_env["CASI_VAR_DIR"])
    done = _casi("train", "--policy", str(tiny_folder), *TRAIN)
    assert done.exit_code == 0, done.output
    path = var / "runs" / "1" / "metrics.jsonl"
    good = path.read_text()
    path.write_text(good + '{"step": 2, "acc')  # the crash tore the next step's write
    resumed = _casi("train", "--resume", "1")
    assert resumed.exit_code == 0, resumed.output
    assert path.read_text() == good
    # a bad line that is not the last: named, and nothing dropped (the resume would redo step 1)
    shutil.rmtree(var / "runs" / "1" / "state")
    path.write_text('{"step": 1, "acc\n' + good)
    before = _run(var)
    refused = _casi("train", "--resume", "1")
    _one_error(refused, f"{path} line 1 is not a metrics record")
    assert _run(var) == before and before[1] == [1]
    assert path.read_text() == '{"step": 1, "acc\n' + good


# --- finding 13: `casi eval --split` before any work ------------------------------------------


def test_eval_refuses_an_unknown_split_before_building_anything(
    cli_env: dict[str, str], tiny_folder: Path
) -> None:
    var = Path(cli_env["CASI_VAR_DIR"])
    refused = _casi("eval", "--policy", str(tiny_folder), "--split", "bogus", "--queries", "2")
    _one_error(refused, "unknown split 'bogus'")
    assert not var.exists() or not any(var.iterdir()), sorted(var.rglob("*"))
