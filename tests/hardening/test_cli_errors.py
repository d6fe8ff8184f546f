"""Issue 13's table: every failure a user can cause ends in ONE clear line (exit 2), run as the
real ``casi`` command in a subprocess against a scratch var dir, real files and databases.

Each case builds its own broken input and names a fragment the one ``error:`` line must hold
(the variable, the file:line, the redacted URL, ...). Cases that need no index fail before
anything heavy loads, so the whole table costs a few seconds per row (imports).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hardening_support import (
    CasiRun,
    casi_env,
    flip_byte,
    free_port,
    read_only,
    run_casi,
    truncate,
)

from app.db import repositories as repo
from app.db import session_scope
from app.db.session import make_engine, make_session_factory, upgrade_to_head

PROTOCOL = (
    Path(__file__).resolve().parents[2] / "docs" / "experiments" / "credit-units" / "protocol.toml"
)
Case = Callable[[Path, Path, Path], tuple[list[str], dict[str, str], tuple[str, ...]]]


def _dataset_copy(tmp: Path, beir: Path) -> Path:
    return Path(shutil.copytree(beir, tmp / "data"))


def _non_utf8(
    tmp: Path, beir: Path, _ck: Path
) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
    data = _dataset_copy(tmp, beir)
    with (data / "queries.jsonl").open("ab") as fh:
        fh.write(b'{"_id": "q9", "text": "caf\xe9"}\n')
    return ["index", "build"], {"CASI_DATASET": str(data)}, ("queries.jsonl:7", "UTF-8")


def _duplicate_query(
    tmp: Path, beir: Path, _ck: Path
) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
    data = _dataset_copy(tmp, beir)
    with (data / "queries.jsonl").open("a", encoding="utf-8") as fh:
        fh.write('{"_id": "q1", "text": "again"}\n')
    return ["index", "build"], {"CASI_DATASET": str(data)}, ("duplicate query id 'q1'",)


def _bad_qrels(cmd: list[str]) -> Case:
    def case(tmp: Path, beir: Path, _ck: Path) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
        data = _dataset_copy(tmp, beir)
        with (data / "qrels" / "train.tsv").open("a", encoding="utf-8") as fh:
            fh.write("q1\tnope\t1\n")
        return cmd, {"CASI_DATASET": str(data)}, ("train.tsv:6", "unknown document id")

    return case


def _env(args: list[str], fragments: tuple[str, ...], **env: str) -> Case:
    return lambda tmp, beir, ck: (args, {"CASI_DATASET": str(beir), **env}, fragments)


def _misfit(params: list[str], fragments: tuple[str, ...]) -> Case:
    """`casi train` of the tiny checkpoint with ``params`` that do not fit it."""
    return lambda tmp, beir, ck: (
        ["train", "--policy", str(ck), *params, "--steps", "1", "--queries", "1",
         "--samples", "2", "--eval-queries", "0"],
        {"CASI_DATASET": str(beir)}, fragments,
    )  # fmt: skip


def _sqlite(kind: str) -> Case:
    def case(tmp: Path, beir: Path, _ck: Path) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
        db = tmp / "casi.db"
        if kind == "folder":
            db.mkdir()
        else:
            conn = sqlite3.connect(db)
            conn.execute("CREATE TABLE t (x TEXT)")
            conn.executemany("INSERT INTO t VALUES (?)", [("x" * 200,)] * 400)
            if kind == "foreign":
                conn.execute("CREATE TABLE alembic_version (version_num TEXT PRIMARY KEY)")
                conn.execute("INSERT INTO alembic_version VALUES ('f00dbeef0000')")
            conn.commit()
            conn.close()
            {
                "garbled": lambda: db.write_bytes(b"not a database " * 100),
                "truncated": lambda: truncate(db),
            }.get(kind, lambda: None)()
        fragment = {"folder": "is a folder", "foreign": "f00dbeef0000"}.get(kind, "damaged")
        return ["db", "upgrade"], {"DATABASE_URL": f"sqlite:///{db}"}, (fragment,)

    return case


def _damaged_checkpoint(
    tmp: Path, beir: Path, ck: Path
) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
    folder = Path(shutil.copytree(ck, tmp / "ckpt"))
    flip_byte(folder / "model.safetensors")
    args = ["rewrite", "--query", "aspirin and heart attacks", "--policy", str(folder)]
    return args, {}, (str(folder), "cannot be rebuilt")


def _truncated_checkpoint(
    tmp: Path, beir: Path, ck: Path
) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
    folder = Path(shutil.copytree(ck, tmp / "ckpt"))
    (folder / "manifest.json").unlink()  # an HF folder without manifest: structure is checked
    truncate(folder / "model.safetensors", 0.7)
    return ["rewrite", "--query", "q", "--policy", str(folder)], {}, ("model.safetensors",)


def _serve_policy_not_a_model(
    tmp: Path, beir: Path, _ck: Path
) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
    folder = tmp / "not-a-model"
    folder.mkdir()
    return SERVE, {"CASI_API_POLICY": str(folder)}, ("CASI_API_POLICY", "no config.json")


def _import_not_an_archive(
    tmp: Path, beir: Path, _ck: Path
) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
    notes = tmp / "start.tar"
    notes.write_text("a policy, I promise")
    return ["policy", "import", str(notes)], {}, (str(notes), "not a readable policy archive")


def _import_damaged(
    tmp: Path, beir: Path, ck: Path
) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
    """A checkpoint folder packed as `casi policy export` packs it, one weight byte flipped."""
    import json
    import tarfile

    archive = tmp / "start.tar"
    folder = Path(shutil.copytree(ck, tmp / "ckpt"))
    record = {"format": "casi-policy/1", "version": "0" * 12, "kind": "trained", "name": "c",
              "base_model": "c", "step": 1, "parent": None, "meta": {}, "recipes": [],
              "made_on": None}  # fmt: skip
    (tmp / "casi-policy.json").write_text(json.dumps(record))
    flip_byte(folder / "model.safetensors")
    with tarfile.open(archive, "w") as tar:
        tar.add(tmp / "casi-policy.json", arcname="casi-policy.json")
        for f in sorted(folder.iterdir()):
            tar.add(f, arcname=f"policy/{f.name}")
    return ["policy", "import", str(archive)], {}, (str(archive), "does not match its sha256")


PG_DOWN = f"postgresql://casi:s3cret@127.0.0.1:{free_port()}/casi"
# Issue 27: `casi serve` checks every setting before uvicorn starts (it died with a traceback
# and exit 3); a free port, so a row that got past the checks would not take a used one.
SERVE = ["serve", "--port", str(free_port())]

CASES: dict[str, Case] = {
    "device-tpu": _env(["index", "build"], ("CASI_DEVICE", "cuda"), CASI_DEVICE="tpu"),
    "retrieval-k-0": _env(
        ["index", "build"], ("CASI_RETRIEVAL_K", "1 to 1000"), CASI_RETRIEVAL_K="0"
    ),
    "retrieval-k-abc": _env(
        ["credit", "--query-id", "q0", "--rewrites", "a"],
        ("CASI_RETRIEVAL_K",),
        CASI_RETRIEVAL_K="abc",
    ),
    "threads-0": _env(["index", "build"], ("CASI_THREADS",), CASI_THREADS="0"),
    "list-k-5000": _env(["index", "build"], ("CASI_LIST_K", "1000"), CASI_LIST_K="5000"),
    "redis-url-http": _env(
        ["index", "build"], ("REDIS_URL", "redis://"), REDIS_URL="http://localhost"
    ),
    "database-url-garbage": _env(["db", "upgrade"], ("DATABASE_URL",), DATABASE_URL="garbage"),
    "postgres-not-listening": _env(
        ["db", "upgrade"], ("cannot connect", "***"), DATABASE_URL=PG_DOWN
    ),
    "sqlite-garbled": _sqlite("garbled"),
    "sqlite-truncated": _sqlite("truncated"),
    "sqlite-folder": _sqlite("folder"),
    "sqlite-foreign-revision": _sqlite("foreign"),
    "corpus-non-utf8": _non_utf8,
    "duplicate-query-id": _duplicate_query,
    "warmstart-bad-dataset": _bad_qrels(["policy", "warmstart", "--steps", "1"]),
    "evaluator-fit-bad-dataset": _bad_qrels(["evaluator", "fit", "--epochs", "1"]),
    "index-eval-bogus-split": _env(["index", "eval", "--split", "bogus"], ("bogus", "test, train")),
    "credit-query-and-id-disagree": _env(
        ["credit", "--query", "not q0's text", "--query-id", "q0", "--rewrites", "a"],
        ("--query and --query-id 'q0' name different queries",),
    ),
    "credit-query-too-long": _env(
        ["credit", "--query", "x" * 100_000, "--rewrites", "a"], ("--query", "100,000")
    ),
    "credit-too-many-rewrites": _env(
        ["credit", "--query-id", "q0", "--rewrites", *"abcdefghijklm"], ("13 rewrites",)
    ),
    "credit-bad-evaluator": _env(
        ["credit", "--query-id", "q0", "--rewrites", "a", "--evaluator", "bm25"], ("bm25",)
    ),
    # training options are derived from the config tree: a bad value is its section's error
    "train-line-cap-1": _env(["train", "--line-cap", "1"], ("line_cap must be >= 2", "--help")),
    "train-params-half": _env(["train", "--params", "half"], ("params must be one of", "'half'")),
    # an infinite lr trained NaN weights and registered them; a huge seed failed mid-run
    "train-lr-inf": _env(["train", "--lr", "inf"], ("lr must be a finite number, got inf",)),
    "train-temperature-inf": _env(["train", "--temperature", "inf"], ("temperature", "finite")),
    "train-seed-2^64": _env(["train", "--seed", str(2**64)], ("seed must be in 0..2^63 - 1",)),
    # a misfit of the policy is told before a run is opened (it was a crash, the run left running)
    "train-top-layers-999": _misfit(
        ["--params", "top", "--top-layers", "999"], ("top_layers must be in 1..", "got 999")
    ),
    "train-lora-targets-unknown": _misfit(
        ["--params", "lora", "--lora-targets", "nope"], ("lora_targets ['nope'] are not modules",)
    ),
    # an option the config never reads was ignored in silence (LoRA rank of a full fine-tune)
    "train-lora-rank-with-full": _env(
        ["train", "--lora-rank", "8"], ("--lora-rank has no effect here", "--params lora")
    ),
    "train-mipu-samples-without-mipu": _env(
        ["train", "--mipu-samples", "4"], ("--mipu-samples has no effect", "'casi' runs no MIPU")
    ),
    # a layer count beyond the model made a share above 1 (the warm start's estimate inflated)
    "estimate-warmstart-top-layers-999": lambda tmp, beir, ck: (
        ["estimate", "--policy", str(ck), "--warmstart-top-layers", "999"],
        {"CASI_DATASET": str(beir)},
        ("--warmstart-top-layers must be in 1..", "got 999"),
    ),
    # the feedback prompt's job is priced at its own token counts; an unknown style is named
    "estimate-prompt-unknown": lambda tmp, beir, ck: (
        ["estimate", "--policy", str(ck), "--prompt", "verbose"],
        {"CASI_DATASET": str(beir)},
        ("--prompt must be one of short, feedback", "got 'verbose'"),
    ),
    "train-resume-with-options": _env(
        ["train", "--resume", "1", "--lr", "0.5", "--name", "x"],
        ("--resume 1 continues the run", "--lr, --name would be ignored"),
    ),
    "train-evaluator-unknown": _env(
        ["train", "--evaluator", "bogus"], ("unknown evaluator 'bogus'", "cosine, replay")
    ),
    # the plan-mode experiment (no --protocol) is retired: one line naming the protocol command
    "experiment-without-protocol": _env(
        ["experiment", "credit", "--n-actions", "9"],
        ("without --protocol is retired", "--protocol"),
    ),
    # the credit experiment's cells: a protocol fixes the settings, a fresh machine has no start
    "experiment-status-out-missing": _env(
        ["experiment", "status", str(PROTOCOL), "--out", "no-such-folder"],
        ("--out no-such-folder: no such results folder",),
    ),
    "experiment-protocol-missing": _env(
        ["experiment", "credit", "--protocol", "no-such.toml", "--environment", "main"],
        ("no protocol file", "no-such.toml"),
    ),
    "experiment-protocol-and-lr": _env(
        [
            "experiment",
            "credit",
            "--protocol",
            str(PROTOCOL),
            "--environment",
            "main",
            "--lr",
            "1e-3",
        ],
        ("--protocol fixes every training setting", "--lr"),
    ),
    "experiment-protocol-bad-environment": _env(
        ["experiment", "credit", "--protocol", str(PROTOCOL), "--environment", "nope"],
        ("no environment 'nope'", "control"),
    ),
    "experiment-protocol-no-start": _env(
        [
            "experiment",
            "credit",
            "--protocol",
            str(PROTOCOL),
            "--environment",
            "main",
            "--seeds",
            "0,",
        ],
        ("no warm start", "casi policy warmstart --batch-size 8"),
    ),
    "experiment-bad-seeds": _env(["experiment", "credit", "--seeds", "3-1"], ("--seeds", "'3-1'")),
    "experiment-aggregate-no-protocol": _env(
        ["experiment", "aggregate", "no-such-folder"], ("no protocol file", "no-such-folder")
    ),
    "eval-format-fancy": _env(["eval", "--format", "fancy"], ("format must be one of", "'fancy'")),
    "eval-guard-free-format": _env(
        ["eval", "--refuse-degenerate", "--format", "free"], ("--refuse-degenerate", "constrained")
    ),
    "checkpoint-flipped-byte": _damaged_checkpoint,
    "checkpoint-truncated-no-manifest": _truncated_checkpoint,
    # a blank value; an empty one (CASI_API_POLICY=) means unset: the default policy
    "serve-policy-empty": _env(SERVE, ("CASI_API_POLICY", "empty"), CASI_API_POLICY=" "),
    "serve-policy-unknown-version": _env(
        SERVE,
        ("CASI_API_POLICY", "'deadbeef99'", "casi report policies"),
        CASI_API_POLICY="deadbeef99",
    ),
    "serve-policy-not-a-model": _serve_policy_not_a_model,
    "serve-precision-float64": _env(
        SERVE, ("CASI_API_PRECISION='float64'", "int8_weight"), CASI_API_PRECISION="float64"
    ),
    "serve-dataset-missing": _env(
        SERVE, ("dataset folder not found", "CASI_DATASET"), CASI_DATASET="no-such-dataset"
    ),
    "policy-option-empty": _env(["rewrite", "--query", "q", "--policy", ""], ("--policy", "empty")),
    "policy-import-not-an-archive": _import_not_an_archive,
    "policy-import-damaged": _import_damaged,
    "policy-import-missing": _env(["policy", "import", "no-such.tar"], ("no archive no-such.tar",)),
    "policy-export-default": _env(
        ["policy", "export", "default:SmolLM2-135M-Instruct", "--out", "x.tar"],
        ("the default policy is not exported",),
    ),
    "policy-export-bad-suffix": _env(
        ["policy", "export", "warmstart", "--out", "x.zip"], ("--out must end in .tar", "'x.zip'")
    ),
}


PARALLEL = 3  # the rows are independent processes: run a few at once, assert one by one


@pytest.fixture(scope="module")
def table(
    tmp_path_factory: pytest.TempPathFactory, tiny_beir: Path, tiny_checkpoint: Path
) -> dict[str, tuple[CasiRun, tuple[str, ...]]]:
    """Every row of CASES, run once (a few at a time); each test below checks one row."""

    def run_row(name: str) -> tuple[CasiRun, tuple[str, ...]]:
        tmp = tmp_path_factory.mktemp(name)
        args, env, fragments = CASES[name](tmp, tiny_beir, tiny_checkpoint)
        return run_casi(args, tmp / "var", **env), fragments

    with ThreadPoolExecutor(PARALLEL) as pool:
        return dict(zip(CASES, pool.map(run_row, CASES), strict=True))


@pytest.mark.integration
@pytest.mark.skipif(
    bool(os.environ.get("DATABASE_URL")),
    reason="every row runs casi on the embedded defaults whatever DATABASE_URL says (casi_env "
    "drops it): the pass without DATABASE_URL (.ci/run's second) runs the same rows",
)
@pytest.mark.parametrize("name", sorted(CASES))
def test_one_clear_error_line(name: str, table: dict[str, tuple[CasiRun, tuple[str, ...]]]) -> None:
    run, fragments = table[name]
    line = run.assert_one_error(*fragments)
    assert "s3cret" not in run.output and " — " in line  # redacted; says how to fix it


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_cuda(
    tmp_path: Path, tiny_beir: Path, casi: Callable[..., CasiRun]
) -> None:
    run = casi(
        ["index", "build"], tmp_path / "var", CASI_DEVICE="cuda", CASI_DATASET=str(tiny_beir)
    )
    run.assert_one_error("CASI_DEVICE=cuda", "cpu")


def test_var_dir_that_is_a_file_fails_before_any_work(
    tmp_path: Path, tiny_beir: Path, casi: Callable[..., CasiRun]
) -> None:
    """Seen: 47 s of embedding, then a traceback. The var folder is checked before the
    dataset is even read: with a dataset folder that has no corpus at all, the error is still
    the var folder's (not a timing assertion: these machines are noisy)."""
    not_a_dir = tmp_path / "var"
    not_a_dir.write_text("I am a file")
    run = casi(["index", "build"], not_a_dir, CASI_DATASET=str(tiny_beir))
    run.assert_one_error("CASI_VAR_DIR", "regular file")
    no_corpus = tmp_path / "no-corpus"
    no_corpus.mkdir()
    run = casi(["index", "build"], not_a_dir, CASI_DATASET=str(no_corpus))
    run.assert_one_error("CASI_VAR_DIR", "regular file")
    assert "corpus" not in run.output


def test_a_dataset_without_qrels_says_where_it_looked(
    tmp_path: Path, casi: Callable[..., CasiRun]
) -> None:
    """Issue 27: a wrong CASI_DATASET said "use one of: none found". It names the folder it
    looked in, why nothing is there, and what a BEIR folder holds."""
    missing = tmp_path / "no-such-dataset"
    run = casi(["index", "eval"], tmp_path / "var", CASI_DATASET=str(missing))
    line = run.assert_one_error(
        str(missing / "qrels"), "does not exist", "(CASI_DATASET)",
        "corpus.jsonl", "queries.jsonl", "qrels/<split>.tsv",
    )  # fmt: skip
    assert "none found" not in line
    empty = tmp_path / "empty"
    empty.mkdir()
    run = casi(["index", "eval", "--dataset", str(empty)], tmp_path / "var")
    run.assert_one_error(str(empty / "qrels"), "no qrels/ folder", "(--dataset)", "BEIR")


def test_estimate_finds_registered_versions(
    tmp_path: Path, tiny_beir: Path, tiny_checkpoint: Path, casi: Callable[..., CasiRun]
) -> None:
    """`casi estimate` looks a registered version up (it was 'neither a registered version nor
    a folder'). (The plan-mode experiment this test also covered is retired, issue 52.)"""
    var = tmp_path / "var"
    url = f"sqlite:///{(var / 'casi.db').as_posix()}"
    upgrade_to_head(url)
    factory = make_session_factory(make_engine(url))
    with session_scope(factory) as session:
        repo.add_policy_version(
            session, version="c" * 12, name="tiny", base_model="tiny",
            path=str(tiny_checkpoint), kind="trained",
        )  # fmt: skip
    run = casi(["estimate", "--policy", "c" * 7, "--steps", "1"], var, CASI_DATASET=str(tiny_beir))
    assert run.returncode == 0, run.output


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
def test_var_dir_that_cannot_be_created_says_so(
    tmp_path: Path, tiny_beir: Path, casi: Callable[..., CasiRun]
) -> None:
    """Issue 27: CASI_VAR_DIR=/proc/casi said "No such file or directory ... (it is created
    if absent)". It says the folder cannot be created there, and the OS's reason."""
    var = Path("/proc/casi")
    run = casi(["index", "build"], var, CASI_DATASET=str(tiny_beir))
    line = run.assert_one_error(
        "cannot create the var folder /proc/casi", "inside /proc", "kernel file system",
        "CASI_VAR_DIR=/proc/casi",
    )  # fmt: skip
    assert "it is created if absent" not in line
    under_a_file = tmp_path / "a-file"
    under_a_file.write_text("x")
    run = casi(["index", "build"], under_a_file / "var", CASI_DATASET=str(tiny_beir))
    run.assert_one_error("cannot create the var folder", "Not a directory")


BOOM = """
import sys, typer
from app.cli.common import run_cli
app = typer.Typer()
@app.command()
def boom(password_url: str = "postgresql://u:hunter2@db/x") -> None:
    raise RuntimeError("kaput at " + password_url)
sys.argv = ["casi"]
run_cli(app)
"""


@pytest.mark.parametrize("debug", ["", "1"])
def test_unexpected_failure_is_one_line_and_a_log(tmp_path: Path, debug: str) -> None:
    import subprocess

    env = casi_env(tmp_path / "var", CASI_DEBUG=debug)
    proc = subprocess.run(
        [sys.executable, "-c", BOOM], env=env, capture_output=True, text=True, timeout=60
    )
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, out
    assert "RuntimeError" in errors[0] and "hunter2" not in out
    logs = list((tmp_path / "var" / "logs").glob("casi-*.log"))
    assert len(logs) == 1 and str(logs[0]) in errors[0]
    body = logs[0].read_text()
    assert "Traceback" in body and "kaput" in body and "hunter2" not in body
    assert ("Traceback" in out) == bool(debug)  # CASI_DEBUG=1 prints it too


SILENT = """
import sys, typer
from app.cli.common import run_cli
app = typer.Typer()
@app.command()
def boom() -> None:
    raise {exc}
sys.argv = ["casi"]
run_cli(app)
"""


@pytest.mark.parametrize("exc", ["MemoryError()", "AssertionError()", "RuntimeError('  ')"])
def test_unexpected_failure_without_a_message_is_one_line(tmp_path: Path, exc: str) -> None:
    """Issue 38, item 9: ``_unexpected`` took ``str(exc).strip().splitlines()[0]``, so an
    exception without a message (a MemoryError, a bare AssertionError) ended in an IndexError
    and two tracebacks. It is one ``error:`` line naming the type, and the log."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", SILENT.format(exc=exc)], env=casi_env(tmp_path / "var"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, out
    assert "Traceback" not in out and "IndexError" not in out, out
    name = exc.partition("(")[0]
    assert f"unexpected failure, {name} — this is a bug" in errors[0], errors[0]
    (log,) = (tmp_path / "var" / "logs").glob("casi-*.log")
    assert str(log) in errors[0] and name in log.read_text()


def test_read_only_folder_outside_the_var_dir_says_make_it_writable(
    tmp_path: Path, casi: Callable[..., CasiRun]
) -> None:
    """Issue 38, item 11: `casi experiment aggregate` on a read-only folder said "set
    CASI_VAR_DIR to a writable folder", which does not help: the folder is not under the var
    dir. The fix names the folder: make it writable, or run on a copy."""
    cells = Path(shutil.copytree(PROTOCOL.parent, tmp_path / "cells"))
    for name in ("table.md", "ndcg.png"):  # what the aggregate writes
        (cells / name).unlink(missing_ok=True)
    with read_only(cells):
        run = casi(["experiment", "aggregate", str(cells)], tmp_path / "var")
    line = run.assert_one_error(str(cells / "table.md"), "make its folder writable", "copy")
    assert "CASI_VAR_DIR" not in line


def test_unwritable_file_under_the_var_dir_still_names_casi_var_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of item 11: under the var dir, another CASI_VAR_DIR is a fix."""
    import errno

    from app.errors import explain

    monkeypatch.setenv("CASI_VAR_DIR", str(tmp_path / "var"))
    inside = explain(
        PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "var" / "x"))
    )
    outside = explain(PermissionError(errno.EROFS, "Read-only file system", str(tmp_path / "y")))
    assert inside is not None and "set CASI_VAR_DIR to a writable folder" in inside.line()
    assert outside is not None and "CASI_VAR_DIR" not in outside.line()
    assert "make its folder writable" in outside.line()


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "run", str(2**64)],
        ["audit", "show", str(2**64)],
        ["keys", "revoke", "0"],
        ["train", "--resume", str(2**63)],
        ["audit", "run", "--evaluator", "cosine", "--from-run", str(2**31)],
    ],
)
def test_a_record_id_beyond_the_database_is_a_usage_error(argv: list[str]) -> None:
    """Ids are int4 on PostgreSQL; a larger one reached SQLite as an OverflowError, reported
    as an "unexpected failure ... this is a bug". Now typer refuses it
    before any work: exit 2, naming the range."""
    from typer.testing import CliRunner

    from app.cli import app

    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert "2147483647" in result.output or "greater than or equal to 1" in result.output
