"""The credit experiment's cells (`app.experiments.cell`) and their aggregate
(`app.experiments.aggregate`) on the tiny format policy, the SciFact slice, real Redis and real
databases: a 2-step cell writes a valid self-describing file; the aggregate of cells from two
seeds and two modes equals a hand computation and is the same bytes twice; results of another
protocol, and cells of one seed from different starts, are refused; a cell killed mid-training
and run again writes the same file as an uninterrupted one (but for its wall time)."""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.experiments.aggregate import aggregate
from app.experiments.cell import evaluate_start, pins, run_cell
from app.experiments.protocol import load_protocol, protocol_hash
from app.experiments.result_file import CELL_FORMAT, cell_path, start_path
from app.experiments.schedule import parse_seeds
from app.experiments.start import Start
from app.settings import Settings
from app.training.evaluate import build_eval_request
from app.training.policy_loader import LoadedPolicy
from evaluator.stats import holm, two_level_bootstrap
from policy.evaluate import EvalConfig
from policy.model import policy_version
from policy.precision import sampler_kernels
from policy.rollout import RolloutConfig

ROOT = Path(__file__).resolve().parents[2]

PROTOCOL = """\
name = "tiny-units"

[start]
steps = 1
batch_size = 2
lr = 1e-4
n_actions = 2
seed = 0
prompt = "short"
train_precision = "float32"

[training]
preset = "casi"
steps = 2
queries = 2
samples = 3
lr = 1e-3
line_cap = 10
micro_batch_size = 4
precision = "float32"
train_precision = "float32"
state_every = 1

[evaluation]
split = "test"
queries = 3

[environments.main]
retriever = "dense"
merge = "max"
anchor = true
n_actions = 2
modes = ["broadcast", "shapley"]
seeds = 2

[[hypotheses]]
name = "shapley > broadcast"
environment = "main"
a = "shapley"
b = "broadcast"
kind = "greater"
family = "primary"

[[hypotheses]]
name = "shapley ≈ broadcast"
environment = "main"
a = "shapley"
b = "broadcast"
kind = "equivalent"
family = "secondary"

[analysis]
resamples = 2000
seed = 0
alpha = 0.05
margin = 0.005
"""


class Killed(Exception):
    """Stands in for a kill between two steps of a cell."""


@pytest.fixture
def units(format_policy, smol_tokenizer, slice_retrieval, train_scorer, db_url, tmp_path):  # type: ignore[no-untyped-def]
    """Everything `run_cell` needs, on the tiny policy; ``cell(out, mode, seed)`` runs one."""
    upgrade_to_head(db_url)
    factory = make_session_factory(make_engine(db_url))
    (tmp_path / "protocol.toml").write_text(PROTOCOL)
    protocol = load_protocol(tmp_path / "protocol.toml")
    env = protocol.environment("main")
    model = copy.deepcopy(format_policy)
    pol = LoadedPolicy(
        model, smol_tokenizer, policy_version(model), "format", "tiny", "tiny", "base"
    )
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    start = Start(pol.version, "recipe-tiny", dict(protocol.start))
    settings = Settings(var_dir=tmp_path / "var")
    request = build_eval_request(
        slice_retrieval, "test", 3, EvalConfig(RolloutConfig(n_actions=2, line_cap=10))
    )
    pin = pins(protocol, env, start, slice_retrieval, settings)

    def cell(
        out: Path, mode: str, seed: int, var: Path | None = None, **kw: Any
    ) -> tuple[Path, bool]:
        return run_cell(
            factory, var or settings.var_dir, out, protocol, env, mode, seed, retrieval=slice_retrieval,
            scorer=train_scorer, policy=pol, start=start, request=request, pin=pin, list_k=10,
            restore=lambda: model.load_state_dict(weights), **kw,
        )  # fmt: skip

    def start_eval(out: Path) -> Path:
        model.load_state_dict(weights)
        return evaluate_start(factory, out, protocol, env, start, pol, request, pin)

    return {"cell": cell, "start_eval": start_eval, "protocol": protocol, "start": start,
            "settings": settings, "tmp": tmp_path}  # fmt: skip


def _without_compute(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    data.pop("compute")
    return data


@pytest.mark.integration
def test_cells_files_aggregate_and_resume(units) -> None:  # type: ignore[no-untyped-def]
    tmp, protocol = units["tmp"], units["protocol"]
    out = tmp  # the results live beside protocol.toml, as in docs/experiments/credit-units/
    units["start_eval"](out)
    paths = {(m, s): units["cell"](out, m, s)[0] for s in (0, 1) for m in ("broadcast", "shapley")}

    # one valid, self-describing file per cell
    cell = json.loads(paths["shapley", 0].read_text())
    assert cell["format"] == CELL_FORMAT and cell["mode"] == "shapley" and cell["seed"] == 0
    assert cell["protocol"] == {"name": "tiny-units", "hash": protocol.hash}
    assert cell["start"] == {"version": units["start"].version, "recipe": "recipe-tiny"}
    assert len(cell["claims"]) == len(cell["ndcg@10"]) == len(cell["recall@100"]) == 3
    assert [s["step"] for s in cell["steps"]] == [1, 2]
    assert all("reward_mean" in s and "gain_mean" in s for s in cell["steps"])
    assert not any(k.startswith(("time/", "cache/")) for s in cell["steps"] for k in s)
    pin = cell["pins"]
    assert pin["precision"] == {"sampler": "float32", "train": "float32", "eval": "float32",
                                "start": "float32"}  # fmt: skip
    for key in ("index_version", "retrieval_k", "torch", "transformers", "cpu_model", "isa_flags"):
        assert pin[key] not in (None, "")
    assert pin["sampler_kernels"] == sampler_kernels("cpu")  # how the float32 sampler multiplied
    assert cell["compute"]["rollouts"] == 2 * 2 * 3 and len(cell["compute"]["step_s"]) == 2
    assert start_path(out, "main", units["start"].version).is_file()
    assert units["cell"](out, "shapley", 0) == (paths["shapley", 0], False)  # done: kept

    # the aggregate equals a hand computation
    result = aggregate(out)
    table = (out / "table.md").read_text()
    png = (out / "ndcg.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    cells = {k: json.loads(p.read_text()) for k, p in paths.items()}
    means = {k: statistics.fmean(c["ndcg@10"]) for k, c in cells.items()}
    summary = result["environments"]["main"]["modes"]
    for mode in ("broadcast", "shapley"):
        vals = [means[mode, 0], means[mode, 1]]
        assert summary[mode]["ndcg@10"] == pytest.approx(
            (statistics.fmean(vals), statistics.stdev(vals))
        )
        assert summary[mode]["per_seed"] == {0: means[mode, 0], 1: means[mode, 1]}
        assert (
            f"| {mode} | 2 | {statistics.fmean(vals):.4f} ± {statistics.stdev(vals):.4f} |" in table
        )
        # the claims on which query + rewrites scores exactly the query alone, counted by hand
        same = [
            sum(x == q for x, q in zip(c["ndcg@10"], c["query_ndcg@10"], strict=True))
            / len(c["ndcg@10"])
            for c in (cells[mode, 0], cells[mode, 1])
        ]
        assert summary[mode]["per_seed_as_query"] == pytest.approx({0: same[0], 1: same[1]})
        assert f"| {mode} | {same[0]:.0%} | {same[1]:.0%} |" in table
    greater = next(r for r in result["hypotheses"] if r["kind"] == "greater")
    d = [means["shapley", s] - means["broadcast", s] for s in (0, 1)]
    assert greater["seeds"] == [0, 1] and greater["missing_seeds"] == []
    assert greater["per_seed_diff"] == pytest.approx(d)
    assert greater["mean_diff"] == pytest.approx(statistics.fmean(d))
    flips = [
        sum(e * x for e, x in zip(signs, d, strict=True))
        for signs in itertools.product((1, -1), repeat=2)
    ]
    by_hand = sum(f >= sum(d) - 1e-12 for f in flips) / 4
    assert greater["sign_flip_p"] == pytest.approx(by_hand)
    a = np.array([cells["shapley", s]["ndcg@10"] for s in (0, 1)])
    b = np.array([cells["broadcast", s]["ndcg@10"] for s in (0, 1)])
    assert (
        greater["p"] == two_level_bootstrap(a, b, n_resamples=2000, seed=0, level=0.95).p_one_sided
    )
    assert greater["p_holm"] == pytest.approx(greater["p"])  # alone in its family
    assert set(greater) >= {"ci_low", "ci_high", "claims_only_ci", "held"}
    assert holm({"x": 0.01, "y": 0.04}) == pytest.approx({"x": 0.02, "y": 0.04})

    # the same files give the same bytes
    aggregate(out)
    assert (out / "table.md").read_text() == table and (out / "ndcg.png").read_bytes() == png

    # a partial aggregate names the missing seeds
    partial = tmp / "partial"
    partial.mkdir()
    shutil.copy(out / "protocol.toml", partial / "protocol.toml")
    (partial / "main").mkdir()
    for (m, s), p in paths.items():
        if (m, s) != ("shapley", 1):
            shutil.copy(p, partial / "main" / p.name)
    shutil.copy(start_path(out, "main", units["start"].version), partial / "main")
    part = aggregate(partial)
    row = next(r for r in part["hypotheses"] if r["kind"] == "greater")
    assert row["seeds"] == [0] and row["missing_seeds"] == [1]
    assert "PARTIAL: 3 of 4 planned cells" in (partial / "table.md").read_text()
    # no verdict before every pre-registered seed is in: "not yet", with what the seeds say so far
    verdict = "yes" if row["held"] else "no"
    assert f"| not yet ({verdict} on 1 of 2 seeds) | 1 |" in (partial / "table.md").read_text()

    # another protocol's file is refused
    other = json.loads(paths["broadcast", 1].read_text())
    other["protocol"]["hash"] = protocol_hash({"name": "other"})
    (partial / "main" / "broadcast-seed1.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="another protocol"):
        aggregate(partial)
    # cells of one seed from different starts are refused
    other = json.loads(paths["broadcast", 1].read_text())
    other["start"]["version"] = "0" * 12
    (partial / "main" / "broadcast-seed1.json").write_text(json.dumps(other))
    shutil.copy(paths["shapley", 1], partial / "main" / "shapley-seed1.json")
    with pytest.raises(ValueError, match="different policies"):
        aggregate(partial)

    # a killed cell, run again, writes the same file as the uninterrupted one
    cut = tmp / "cut"
    seen: list[int] = []

    def kill_after_first_step(result: Any) -> None:
        seen.append(result.step)
        if result.step == 1:
            raise Killed

    with pytest.raises(Killed):
        units["cell"](cut, "shapley", 1, var=tmp / "var2", on_step=kill_after_first_step)
    assert not cell_path(cut, "main", "shapley", 1).exists()
    resumed: list[int] = []
    path, ran = units["cell"](
        cut, "shapley", 1, var=tmp / "var2", on_step=lambda r: resumed.append(r.step)
    )
    assert ran and resumed == [2]  # the killed cell continues after its last state
    assert _without_compute(path) == _without_compute(paths["shapley", 1])
    assert json.loads(path.read_text())["compute"]["resumed_at"] == 1


SECOND_RUN_CELL = """
import sys
from pathlib import Path
from app.experiments.cell import run_cell
from app.experiments.protocol import load_protocol
protocol = load_protocol(Path(sys.argv[1]))
try:
    run_cell(None, Path(sys.argv[2]), Path(sys.argv[3]), protocol, protocol.environment("main"),
             "shapley", 0, retrieval=None, scorer=None, policy=None, start=None, request=None,
             pin={}, list_k=10, restore=lambda: None)
except ValueError as exc:
    print(exc)
    sys.exit(3)
"""


def _second_process(args: list[str], var: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CASI_") and k not in ("DATABASE_URL", "REDIS_URL")}  # fmt: skip
    env.update(CASI_VAR_DIR=str(var), COLUMNS="300", HF_HUB_OFFLINE="1")
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_a_cell_is_trained_by_one_process_at_a_time(units) -> None:  # type: ignore[no-untyped-def]
    """Issue 38: the same `casi experiment credit --seeds 0,` started twice resumed one run in
    two processes (one state, one metrics.jsonl, one cell file); so did two processes with
    different var folders writing one results folder. While this process trains
    main/shapley-seed0, a second process asking for that cell is refused in one line naming
    the cell and this process's pid: the real command (before it loads the start), and
    `run_cell` itself (its lock, held through training and evaluation)."""
    tmp = units["tmp"]
    out, var = tmp / "results", units["settings"].var_dir
    busy = (
        f"cell main/shapley-seed0 is being trained by another casi process (pid {os.getpid()}): "
        "let it finish, or stop it and run this again to resume the cell"
    )
    seconds: list[subprocess.CompletedProcess[str]] = []

    def second_processes(result: Any) -> None:
        if result.step != 1:
            return
        casi = str(Path(sys.executable).parent / "casi")
        command = [casi, "experiment", "credit", "--protocol", str(tmp / "protocol.toml"),
                   "--environment", "main", "--modes", "shapley", "--seeds", "0", "--out", str(out)]  # fmt: skip
        seconds.append(_second_process(command, var))
        code = [
            sys.executable,
            "-c",
            SECOND_RUN_CELL,
            str(tmp / "protocol.toml"),
            str(var),
            str(out),
        ]
        seconds.append(_second_process(code, var))
        # another var folder (its own run records) writing the same results folder
        other = tmp / "var-other"
        seconds.append(_second_process([*code[:4], str(other), str(out)], other))

    path, ran = units["cell"](out, "shapley", 0, on_step=second_processes)
    cli, direct, elsewhere = seconds
    assert cli.returncode == 2, cli.stdout + cli.stderr
    errors = [line for line in (cli.stdout + cli.stderr).splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: {busy} — "), errors
    assert direct.returncode == 3, direct.stdout + direct.stderr
    assert direct.stdout == busy + "\n"
    assert elsewhere.returncode == 3 and elsewhere.stdout == busy + "\n", elsewhere.stderr
    # the first process's cell is whole, its run the only one, and its lock gone
    assert ran and json.loads(path.read_text())["seed"] == 0
    side = var / "units" / units["protocol"].hash / "main"
    assert sorted(p.name for p in side.iterdir()) == ["shapley-seed0.json"]
    assert not (out / "main" / "shapley-seed0.tmp").exists()
    assert [p.name for p in (out / "main").iterdir() if p.name.startswith(".")] == []  # no lock
    assert units["cell"](out, "shapley", 0) == (path, False)


def test_protocol_checks(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(PROTOCOL)
    p = load_protocol(path)
    assert p.hash == load_protocol(path).hash
    path.write_text("# a comment changes nothing\n" + PROTOCOL)
    assert load_protocol(path).hash == p.hash
    path.write_text(PROTOCOL.replace("lr = 1e-3", "lr = 2e-3"))
    assert load_protocol(path).hash != p.hash
    for bad, message in (
        (PROTOCOL.replace('precision = "float32"\ntrain', 'precision = "auto"\ntrain'), "never auto"),
        (PROTOCOL.replace('queries = 3', 'queries = "some"'), "queries = 'some': must be"),
        (PROTOCOL.replace('state_every = 1', 'state_every = 1\nseed = 3'), "may not be set"),
        (PROTOCOL.replace('modes = ["broadcast", "shapley"]', 'modes = ["broadcast", "shapley", "fancy"]'), "fancy"),
        (PROTOCOL.replace('b = "broadcast"\nkind = "greater"', 'b = "singleton"\nkind = "greater"'), "not in its environment"),
        (PROTOCOL.replace('lr = 1e-3', 'lr = -1.0'), "lr"),
        ("name = ", "not valid TOML"),
    ):  # fmt: skip
        path.write_text(bad)
        with pytest.raises(ValueError, match=message):
            load_protocol(path)
    with pytest.raises(ValueError, match="no environment 'nope'"):
        p.environment("nope")
    with pytest.raises(FileNotFoundError):
        load_protocol(tmp_path / "missing.toml")


def test_parse_seeds() -> None:
    assert parse_seeds("3") == [3]  # seed 3 alone (tests/experiments/test_seeds.py: the syntax)
    assert parse_seeds("0") == [0] and parse_seeds("0-2") == [0, 1, 2]
    assert parse_seeds("2-4") == [2, 3, 4]
    assert parse_seeds("5,") == [5] and parse_seeds("1,3") == [1, 3]
    for bad in ("a", "3-1", "1,1", "-2", "0,,1"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


def test_a_run_pins_its_start(db_url: str, tmp_path: Path) -> None:
    """`--policy warmstart` is stored as the version it resolved to, and a resume whose reference
    now loads other weights (a newer warm start) is refused."""
    from app.db import repositories as repo
    from app.db import session_scope
    from app.training.runs import RunHandle, check_start, pin_start

    upgrade_to_head(db_url)
    factory = make_session_factory(make_engine(db_url))
    old = LoadedPolicy(None, None, "a" * 12, "warmstart", "base", "/w/old", "warmstart")
    new = LoadedPolicy(None, None, "b" * 12, "warmstart", "base", "/w/new", "warmstart")
    meta: dict[str, Any] = {"policy": "warmstart"}
    pin_start(meta, old)
    assert meta == {"policy": "a" * 12, "policy_ref": "warmstart"}
    with session_scope(factory) as session:
        pv_id = repo.get_or_add_policy_version(
            session, version=old.version, name="warmstart", base_model="base", path="/w/old",
            kind="warmstart",
        ).id  # fmt: skip
    handle = RunHandle(7, tmp_path, 3, pv_id)
    check_start(factory, handle, old, "warmstart")  # the same weights: fine
    with pytest.raises(ValueError, match="refusing to resume from another start"):
        check_start(factory, handle, new, "warmstart")
