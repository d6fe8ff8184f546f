"""Issue 50's protocol pieces for a policy that reads its first retrieval: hypotheses against a
baseline (keyword expansion, the query alone, the equal budget) read off A's cells and tested
with the same two-level bootstrap; the served nDCG@10 per claim and the degenerate rate in a
cell's file; the teacher's [start] and the learning curve's [evaluation] keys."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.experiments.aggregate import aggregate
from app.experiments.cell import _pool_rows
from app.experiments.protocol import BASELINE_METRICS, load_protocol, protocol_hash
from app.experiments.result_file import check_result
from app.experiments.schedule import protocol_status
from evaluator.stats import two_level_bootstrap

ROOT = Path(__file__).resolve().parents[2]
POOLED = ROOT / "docs" / "experiments" / "credit-pool"
TEXT = (POOLED / "protocol.toml").read_text(encoding="utf-8")

BASELINE_HYPOTHESES = """
[[hypotheses]]
name = "shapley > keyword_expansion"
environment = "pool"
a = "shapley"
b = "keyword_expansion"
kind = "greater"
family = "baselines"

[[hypotheses]]
name = "shapley > budget"
environment = "pool"
a = "shapley"
b = "budget"
kind = "greater"
family = "baselines"
"""


def _with(text: str, extra: str) -> str:
    """``text`` with ``extra`` (hypotheses) before [analysis] and 200 resamples."""
    at = text.index("[analysis]")
    return (text[:at] + extra.lstrip("\n") + "\n" + text[at:]).replace(
        "resamples = 10000", "resamples = 200"
    )


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "protocol.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_baseline_hypothesis_reads_the_baselines_key(tmp_path: Path) -> None:
    protocol = load_protocol(_write(tmp_path, _with(TEXT, BASELINE_HYPOTHESES)))
    keys = {h.name: protocol.baseline_key(h) for h in protocol.hypotheses}
    assert keys["shapley > keyword_expansion"] == "prf_recall"
    assert keys["shapley > budget"] == "budget_recall"
    assert keys["shapley > broadcast"] is None  # a mode: its own cells
    assert protocol.held == ("pool_recall", "overlap", "prf_recall", "budget_recall")
    assert BASELINE_METRICS["keyword_expansion"]["served_ndcg@10"] == "prf_served_ndcg@10"
    assert BASELINE_METRICS["query"]["ndcg@10"] == "query_ndcg@10"


@pytest.mark.parametrize(
    ("b", "metric", "usable"),
    [
        ("budget", "ndcg@10", "keyword_expansion, query"),  # the budget has no served list
        ("budget", "overlap", "none"),
        ("random", "pool_recall", "keyword_expansion, query, budget"),
    ],
)
def test_a_b_that_is_neither_a_mode_nor_a_usable_baseline_is_refused(
    tmp_path: Path, b: str, metric: str, usable: str
) -> None:
    extra = (f'[[hypotheses]]\nname = "x"\nenvironment = "pool"\na = "shapley"\nb = "{b}"\n'
             f'kind = "greater"\nmetric = "{metric}"\n')  # fmt: skip
    with pytest.raises(ValueError) as info:
        load_protocol(_write(tmp_path, _with(TEXT, extra)))
    assert f"[hypotheses[5]] b = '{b}': not in its environment's modes" in str(info.value)
    assert f"nor a baseline of {metric} ({usable})" in str(info.value)


def _pooled_copy(tmp_path: Path, text: str) -> Path:
    """The committed pooled cells under ``text`` (their hash re-labelled)."""
    dst = tmp_path / "credit-pool"
    shutil.copytree(POOLED / "pool", dst / "pool")
    (dst / "protocol.toml").write_text(text, encoding="utf-8")
    new_hash = protocol_hash(tomllib.loads(text))
    for path in dst.glob("*/*.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        data["protocol"]["hash"] = new_hash
        path.write_text(json.dumps(data), encoding="utf-8")
    return dst


def test_a_baseline_hypothesis_is_tested_on_as_cells_alone(tmp_path: Path) -> None:
    """B's per-claim values are the A cell's own baseline values (the same deterministic
    baseline in every cell), through the same two-level bootstrap; a seed needs only A's cell,
    and the status asks for nothing beyond the environment's modes."""
    dst = _pooled_copy(tmp_path, _with(TEXT, BASELINE_HYPOTHESES))
    for mode in ("broadcast", "singleton"):  # B's cells of seed 5 gone: the baselines still test
        (dst / "pool" / f"{mode}-seed5.json").unlink()
    result = aggregate(dst)
    cells = {s: json.loads((dst / "pool" / f"shapley-seed{s}.json").read_text()) for s in range(6)}
    rows = {r["name"]: r for r in result["hypotheses"]}
    for name, key in (("shapley > keyword_expansion", "prf_recall"),
                      ("shapley > budget", "budget_recall")):  # fmt: skip
        row = rows[name]
        assert row["seeds"] == list(range(6)) and row["missing_seeds"] == []
        a = np.array([cells[s]["pool_recall"] for s in range(6)])
        b = np.array([cells[s][key] for s in range(6)])
        assert (
            row["p"] == two_level_bootstrap(a, b, n_resamples=200, seed=0, level=0.95).p_one_sided
        )
        per_seed = [statistics.fmean(cells[s]["pool_recall"]) - statistics.fmean(cells[s][key])
                    for s in range(6)]  # fmt: skip
        np.testing.assert_allclose(row["per_seed_diff"], per_seed, rtol=0, atol=1e-12)
    assert rows["shapley > broadcast"]["missing_seeds"] == [5]  # a mode's B: its own cells
    table = (dst / "table.md").read_text(encoding="utf-8")
    assert "| shapley > keyword_expansion | baselines | 6 |" in table
    assert "| shapley > budget | baselines | 6 |" in table
    protocol = load_protocol(dst / "protocol.toml")
    status = {r.seed: r for r in protocol_status(dst, protocol, None, (), [])}
    assert status[5].missing == ("broadcast", "singleton")  # modes only, never a baseline
    assert all(status[s].here == "done" for s in range(5))


def test_a_cell_without_the_baselines_values_is_refused(tmp_path: Path) -> None:
    dst = _pooled_copy(tmp_path, _with(TEXT, BASELINE_HYPOTHESES))
    path = dst / "pool" / "shapley-seed2.json"
    data = json.loads(path.read_text())
    data.pop("prf_recall")
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"pool/shapley-seed2.json: field 'prf_recall'"):
        aggregate(dst)


def _row(i: int, served: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"pool": [0.1, 0.2, 0.3], "budget": 0.25, "prf": 0.2, "prf_ndcg": 0.4,
                           "overlap": 0.5, "query_id": str(i)}  # fmt: skip
    if served:
        row.update(served_ndcg=0.6 + i / 100, prf_served_ndcg=0.5 - i / 100)
    return row


def test_a_cell_records_the_served_ndcg_per_claim_where_the_evaluation_has_it() -> None:
    got = _pool_rows([_row(0, True), _row(1, True)])
    assert got["served_ndcg@10"] == [0.6, 0.61] and got["prf_served_ndcg@10"] == [0.5, 0.49]
    assert "served_ndcg@10" not in _pool_rows([_row(0, False), _row(1, False)])


def _start_file(**extra: Any) -> dict[str, Any]:
    return {"format": "casi-credit-start/1", "environment": "pool",
            "protocol": {"name": "p", "hash": "0123456789abcdef"}, "start": {"version": "abcdef12"},
            "claims": ["1", "2"], "ndcg@10": [0.1, 0.2], "recall@100": [0.1, 0.2],
            "query_ndcg@10": [0.1, 0.2], **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"served_ndcg@10": [0.5, 1.5]}, "field 'served_ndcg@10'[1] = 1.5 is outside [0, 1]"),
        ({"prf_served_ndcg@10": [0.5]}, "field 'prf_served_ndcg@10' has 1 values for 2 claims"),
        (
            {"eval_metrics": {"degenerate_rate": 1.2}},
            "field 'eval_metrics.degenerate_rate' = 1.2 is outside [0, 1]",
        ),
    ],
)
def test_the_served_ndcg_and_degenerate_rate_are_checked(
    extra: dict[str, Any], message: str
) -> None:
    check_result(_start_file(served_ndcg=None), "ok")  # an unknown key is not checked
    check_result(_start_file(**{"served_ndcg@10": [0.0, 1.0]}), "ok")
    with pytest.raises(ValueError) as info:
        check_result(_start_file(**extra), "pool/start-abcdef12.json")
    assert str(info.value) == f"pool/start-abcdef12.json: {message}"


# ---------------------------------------------------------------------------- the curve


CURVE = '[evaluation]\nsplit = "test"\nqueries = 3\ncurve_split = "dev"\ncurve_every = 1\ncurve_queries = 2\n'


def test_a_curve_is_measured_on_dev_or_val_only_and_an_absent_one_keeps_the_hash(
    tmp_path: Path,
) -> None:
    assert load_protocol(POOLED / "protocol.toml").curve is None
    text = TEXT.replace(
        "[evaluation]  # greedy", '[evaluation]\ncurve_split = "val"\ncurve_every = 4\n#'
    )
    assert load_protocol(_write(tmp_path, text)).curve == {
        "split": "val",
        "every": 4,
        "queries": "all",
    }
    for bad, fragment in (('curve_split = "test"', "curve_split = 'test': must be one of dev, val"),
                          ("curve_every = 0", "curve_every = 0: must be an integer >= 1"),
                          ('curve_queries = "some"', "curve_queries = 'some': must be 'all' or N")):  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            load_protocol(_write(tmp_path, text.replace('curve_split = "val"', bad, 1)
                                 if "split" in bad else text.replace("curve_every = 4", f"curve_every = 4\n{bad}" if "queries" in bad else bad)))  # fmt: skip
    with pytest.raises(ValueError, match="needs both curve_split and curve_every"):
        load_protocol(_write(tmp_path, text.replace('curve_split = "val"\n', "")))


@pytest.fixture
def curve_cell(format_policy, smol_tokenizer, nf_slice, db_url, tmp_path):  # type: ignore[no-untyped-def]
    """``cell(out, var, mode, seed, on_step)`` runs one pooled cell of a 2-step protocol with a
    curve on 2 DEV claims every step, on the tiny policy and the NFCorpus slice."""

    from app.db.session import make_engine, make_session_factory, upgrade_to_head
    from app.experiments.cell import cell_settings, evaluate_start, pins, run_cell
    from app.runtime import build_retrieval, build_scorer
    from app.settings import Settings
    from app.training.evaluate import held_out_request
    from tests.experiments.test_pool_cells import POOL_PROTOCOL, tiny_start

    upgrade_to_head(db_url)
    factory = make_session_factory(make_engine(db_url))
    text = POOL_PROTOCOL.format(dataset=nf_slice).replace(
        "steps = 1\nqueries = 2", "steps = 2\nqueries = 2"
    )
    text = text.replace('[evaluation]\nsplit = "test"\nqueries = 3\n', CURVE)
    protocol = load_protocol(_write(tmp_path, text))
    env = protocol.environment("pool")
    model, pol, weights, start = tiny_start(format_policy, smol_tokenizer, protocol)
    built: dict[str, Any] = {}

    def cell(out: Path, var: Path, mode: str, seed: int, on_step: Any = None) -> Path:
        settings = cell_settings(Settings(var_dir=var), protocol, env)
        if "r" not in built:
            r = built["r"] = build_retrieval(settings, retriever=env.retriever)
            rollout = protocol.train_config(env, mode, seed, settings.list_k).rollout
            built.update(scorer=build_scorer("replay", settings, r, split="train"),
                         request=held_out_request(r, rollout, "test", 3),
                         curve=held_out_request(r, rollout, "dev", 2),
                         pin=pins(protocol, env, start, r, settings))  # fmt: skip
        model.load_state_dict(weights)
        evaluate_start(factory, out, protocol, env, start, pol, built["request"], built["pin"])
        return run_cell(
            factory, var, out, protocol, env, mode, seed, retrieval=built["r"],
            scorer=built["scorer"], policy=pol, start=start, request=built["request"],
            pin=built["pin"], list_k=settings.list_k, on_step=on_step, curve=built["curve"],
            restore=lambda: model.load_state_dict(weights),
        )[0]  # fmt: skip

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for name in ("a", "b"):
        shutil.copy(tmp_path / "protocol.toml", tmp_path / name / "protocol.toml")
    return cell, protocol


class Killed(Exception):
    pass


@pytest.mark.integration
def test_a_cell_records_its_dev_curve_and_keeps_it_through_a_kill(curve_cell, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cell, protocol = curve_cell
    whole = json.loads(cell(tmp_path / "a", tmp_path / "var-a", "shapley", 0).read_text())
    curve = whole["curve"]
    assert [p["step"] for p in curve] == [1, 2]  # every step (curve_every = 1), the last one too
    for point in curve:
        assert (
            {"pool_recall", "prf_pool_recall", "budget_pool_recall"}
            <= set(point)
            <= {"step", "pool_recall", "prf_pool_recall", "budget_pool_recall", "served_ndcg@10"}
        )
        assert all(0.0 <= v <= 1.0 for k, v in point.items() if k != "step")
    expected = protocol.train_config(
        protocol.environment("pool"), "shapley", 0, whole["pins"]["list_k"]
    ).to_dict()
    assert whole["config"] == json.loads(json.dumps(expected))  # the protocol's, no eval schedule

    def kill(result: Any) -> None:
        if result.step == 1:
            raise Killed

    with pytest.raises(Killed):
        cell(tmp_path / "b", tmp_path / "var-b", "shapley", 0, on_step=kill)
    side = tmp_path / "var-b" / "units" / protocol.hash / "pool" / "shapley-seed0.json"
    assert [p["step"] for p in json.loads(side.read_text())["curve"]] == [
        1
    ]  # kept through the kill
    resumed = json.loads(cell(tmp_path / "b", tmp_path / "var-b", "shapley", 0).read_text())
    assert resumed["curve"] == curve  # the same points as the uninterrupted cell's
    assert resumed["compute"]["resumed_at"] == 1
    aggregate(tmp_path / "b")  # a file with a curve is a good file
    bad = dict(resumed, curve=[curve[1], curve[0]])
    with pytest.raises(ValueError, match=r"'curve'\[1\].step = 1 must be an integer step after 2"):
        check_result(bad, "pool/shapley-seed0.json")


# ---------------------------------------------------------------------------- the teacher's start


TEACHER = '[start]\nsteps = 1\nbatch_size = 2\nlr = 1e-4\nn_actions = 2\nseed = 0\nqueries = 2\nprompt = "feedback"\ntrain_precision = "float32"\nsource = "prf"\nfeedback_words = 8\n'


def _teacher_protocol(nf_slice: Path, policy: str | None = None) -> str:
    from tests.experiments.test_pool_cells import POOL_PROTOCOL

    text = POOL_PROTOCOL.format(dataset=nf_slice)
    start = text[text.index("[start]") : text.index("[training]")]
    head = TEACHER.replace("[start]\n", f'[start]\npolicy = "{policy}"\n') if policy else TEACHER
    return text.replace(start, head + "\n")


@pytest.mark.parametrize(
    ("old", "new", "fragment"),
    [
        (
            "feedback_words = 8",
            "feedback_words = 65",
            "feedback_words = 65: must be an integer in 1..64",
        ),
        ('prompt = "feedback"', 'prompt = "short"', "source prf and prompt feedback go together"),
        ('source = "prf"', 'source = "openings"', "source prf and prompt feedback go together"),
    ],
)
def test_the_teachers_start_is_checked(
    tmp_path: Path, nf_slice: Path, old: str, new: str, fragment: str
) -> None:
    text = _teacher_protocol(nf_slice)
    assert load_protocol(_write(tmp_path, text)).start["feedback_words"] == 8
    with pytest.raises(ValueError, match=re.escape(fragment)):
        load_protocol(_write(tmp_path, text.replace(old, new, 1)))


@pytest.mark.integration
def test_the_printed_command_makes_the_teachers_start_that_resolve_start_finds(
    tmp_path: Path, nf_slice: Path, smol_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start of a prf protocol is made under its environment's game (the teacher reads the
    game's index): the printed command sets those settings in front, and the start it makes is
    the one `resolve_start` finds (one recipe key, `start_recipe`, for both)."""
    import shlex

    from typer.testing import CliRunner

    from app.cli import app
    from app.db.session import make_engine, make_session_factory, upgrade_to_head
    from app.experiments.cell import cell_settings
    from app.experiments.start import resolve_start, warmstart_command
    from app.settings import Settings, get_settings
    from policy.model import build_tiny_policy, save_checkpoint

    base = save_checkpoint(
        build_tiny_policy(smol_tokenizer, seed=0), smol_tokenizer, tmp_path / "t"
    )
    protocol = load_protocol(_write(tmp_path, _teacher_protocol(nf_slice, str(base))))
    env = protocol.environment("pool")
    settings = cell_settings(Settings(var_dir=tmp_path / "var", threads=1), protocol, env)
    command = warmstart_command(protocol.start, protocol.dataset, settings)
    assert command.startswith(
        "CASI_GAME=pool CASI_MERGE=pool CASI_RETRIEVER=bm25 CASI_BM25_STEMMER=none "
        f"CASI_BM25_RULES=1 CASI_RETRIEVAL_K=5 CASI_DATASET={nf_slice} casi policy warmstart "
    )
    assert "--feedback-words 8" in command and "--source prf" in command
    words = shlex.split(command)
    at = words.index("casi")
    for name in ("DATABASE_URL", "REDIS_URL", "CASI_MAX_DOCS", "CASI_DEVICE", "CASI_LIST_K"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CASI_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("CASI_THREADS", "1")
    monkeypatch.setenv("CASI_MERGE", "rrf")  # this shell's own game: the command's wins
    for word in words[:at]:
        monkeypatch.setenv(*word.split("=", 1))
    get_settings.cache_clear()
    try:  # the protocol's policy is not a flag of the printed command: given here
        done = CliRunner().invoke(app, [*words[at + 1 :], "--policy", str(base)])
    finally:
        get_settings.cache_clear()
    assert done.exit_code == 0, done.output
    url = f"sqlite:///{tmp_path / 'r.db'}"
    upgrade_to_head(url)
    factory = make_session_factory(make_engine(url))
    _, start = resolve_start(protocol, settings, factory)
    assert f"models/warmstart-{start.version}" in done.output  # the start the command made
    other = load_protocol(
        _write(
            tmp_path,
            _teacher_protocol(nf_slice, str(base)).replace(
                "feedback_words = 8", "feedback_words = 9"
            ),
        )
    )
    with pytest.raises(FileNotFoundError, match="--feedback-words 9"):  # another recipe
        resolve_start(other, settings, factory)


# ---------------------------------------------------------------------------- the guard


def test_a_protocol_that_refuses_degenerate_rewrites_evaluates_as_serving_decodes(
    nf_slice: Path, tmp_path: Path
) -> None:
    """``[evaluation] refuse_degenerate = true``: the start's, the cells' and the curve's
    held-out requests decode with serving's degenerate guard; absent, none does, and the key
    changes the hash (a new protocol)."""
    from app.experiments.cell import cell_settings, held_out_requests
    from app.runtime import build_retrieval
    from app.settings import Settings
    from tests.experiments.test_pool_cells import POOL_PROTOCOL

    text = POOL_PROTOCOL.format(dataset=nf_slice)
    text = text.replace('[evaluation]\nsplit = "test"\nqueries = 3\n', CURVE)
    (tmp_path / "plain").mkdir()
    (tmp_path / "guarded").mkdir()
    plain = load_protocol(_write(tmp_path / "plain", text))
    guarded = load_protocol(_write(tmp_path / "guarded", text.replace(CURVE, CURVE + "refuse_degenerate = true\n")))  # fmt: skip
    assert (plain.refuse_degenerate, guarded.refuse_degenerate) == (False, True)
    assert plain.hash != guarded.hash
    with pytest.raises(ValueError, match="refuse_degenerate = 'yes': must be true or false"):
        load_protocol(_write(tmp_path, text.replace(CURVE, CURVE + 'refuse_degenerate = "yes"\n')))
    env = plain.environment("pool")
    settings = cell_settings(Settings(var_dir=tmp_path / "var"), plain, env)
    r = build_retrieval(settings, retriever=env.retriever)
    for protocol in (plain, guarded):
        rollout = protocol.train_config(env, "shapley", 0, settings.list_k).rollout
        held, curve = held_out_requests(protocol, r, rollout)
        assert curve is not None
        assert (held.split, len(held.queries), curve.split, len(curve.queries)) == (
            "test",
            3,
            "dev",
            2,
        )
        assert (
            held.config.refuse_degenerate
            is curve.config.refuse_degenerate
            is protocol.refuse_degenerate
        )
