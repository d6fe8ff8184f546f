"""Issue 38, items 2-6 and the write half of item 1, on a copy of the committed SciFact results
(docs/experiments/credit-units/): `casi experiment aggregate` checks every file before it
computes or writes anything, each refusal ONE line naming the file (and the field), and
table.md / ndcg.png are written only after every check passed, atomically. The committed
folder still gives the committed table.md and ndcg.png byte for byte."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import app.experiments.aggregate as units_aggregate
from app.experiments.aggregate import aggregate
from app.experiments.protocol import protocol_hash
from app.experiments.result_file import write_json
from evaluator.stats import two_level_bootstrap

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "experiments" / "credit-units"
STALE = "a table.md from before: a refused aggregate leaves it as it was\n"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A copy of the committed results (protocol, both environments, table.md, ndcg.png)."""
    dst = tmp_path / "credit-units"
    shutil.copytree(COMMITTED, dst, ignore=shutil.ignore_patterns("selection", "README.md"))
    return dst


def _edit(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def _refused(folder: Path, message: str) -> None:
    """The aggregate of ``folder`` is refused with exactly ``message``, and writes nothing."""
    (folder / "table.md").write_text(STALE, encoding="utf-8")
    png = (folder / "ndcg.png").read_bytes()
    with pytest.raises(ValueError) as info:
        aggregate(folder)
    assert str(info.value) == message
    assert (folder / "table.md").read_text(encoding="utf-8") == STALE
    assert (folder / "ndcg.png").read_bytes() == png
    assert sorted(p.name for p in folder.iterdir()) == [
        "control", "main", "ndcg.png", "protocol.toml", "table.md",
    ]  # fmt: skip


def test_the_committed_results_give_the_committed_table_byte_for_byte(folder: Path) -> None:
    # a writer's lock and temporary files (hidden) are passed over
    (folder / "main" / ".shapley-seed3.json.tmp-x1y2").write_text("half a file")
    (folder / "main" / ".shapley-seed3.json.lock").write_text("4242\n")
    result = aggregate(folder)
    assert (folder / "table.md").read_bytes() == (COMMITTED / "table.md").read_bytes()
    assert (folder / "ndcg.png").read_bytes() == (COMMITTED / "ndcg.png").read_bytes()
    assert result["metric"] == "ndcg@10"
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == [
        "ndcg.png", "protocol.toml", "table.md",
    ]  # fmt: skip  # no temporary file left behind


SHAPLEY3 = "main/shapley-seed3.json"
START = "control/start-d67b684cf777.json"


def _set(key: str, value: Any, index: int | None = None) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        node, *path = key.split(".")
        target = data
        for part in [node, *path][:-1]:
            target = target[part]
        last = [node, *path][-1]
        if index is None:
            target[last] = value
        else:
            target[last][index] = value

    return change


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        *path, last = key.split(".")
        target = data
        for part in path:
            target = target[part]
        del target[last]

    return change


VALUES = {
    "ndcg 7.0": (SHAPLEY3, _set("ndcg@10", 7.0, 17), "field 'ndcg@10'[17] = 7.0 is outside [0, 1]"),
    "ndcg negative": (SHAPLEY3, _set("ndcg@10", -0.1, 0), "field 'ndcg@10'[0] = -0.1 is outside [0, 1]"),
    "recall NaN": (SHAPLEY3, _set("recall@100", math.nan, 4), "field 'recall@100'[4] = nan is not a finite number"),
    "recall inf": (SHAPLEY3, _set("recall@100", math.inf, 4), "field 'recall@100'[4] = inf is not a finite number"),
    "a string": (SHAPLEY3, _set("query_ndcg@10", "0.5", 2), "field 'query_ndcg@10'[2] = '0.5' is not a number"),
    "a bool": (SHAPLEY3, _set("ndcg@10", True, 2), "field 'ndcg@10'[2] = True is not a number"),
    "a metric not a list": (SHAPLEY3, _set("ndcg@10", 0.5), "field 'ndcg@10' = 0.5 must be a list of one number per claim"),
    "a list too short": (SHAPLEY3, lambda d: d["recall@100"].pop(), "field 'recall@100' has 299 values for 300 claims"),
    "no ndcg": (SHAPLEY3, _drop("ndcg@10"), "field 'ndcg@10' is missing"),
    "no query ndcg": (SHAPLEY3, _drop("query_ndcg@10"), "field 'query_ndcg@10' is missing"),
    "no claims": (SHAPLEY3, _drop("claims"), "field 'claims' is missing"),
    "claims repeat": (SHAPLEY3, lambda d: d["claims"].__setitem__(1, d["claims"][0]), "field 'claims'[1] = '1' appears twice"),
    "no steps": (SHAPLEY3, _drop("steps"), "field 'steps' is missing"),
    "a step without reward": (SHAPLEY3, lambda d: d["steps"][3].pop("reward_mean"), "field 'steps'[3].reward_mean is missing"),
    "a step's advantage": (SHAPLEY3, lambda d: d["steps"][0].__setitem__("adv_abs_mean", "x"), "field 'steps'[0].adv_abs_mean = 'x' is not a number"),
    "no wall time": (SHAPLEY3, _drop("compute.wall_s"), "field 'compute.wall_s' is missing"),
    "compute a list": (SHAPLEY3, _set("compute", []), "field 'compute' = [] must be an object"),
    "negative wall time": (SHAPLEY3, _set("compute.wall_s", -5.0), "field 'compute.wall_s' = -5.0 is below 0"),
    "a duplicate rate": (SHAPLEY3, _set("eval_metrics.duplicate_rate", 1.5), "field 'eval_metrics.duplicate_rate' = 1.5 is outside [0, 1]"),
    "seed a string": (SHAPLEY3, _set("seed", "3"), "field 'seed' = '3' must be an integer >= 0"),
    "seed a bool": (SHAPLEY3, _set("seed", True), "field 'seed' = True must be an integer >= 0"),
    "seed a float": (SHAPLEY3, _set("seed", 3.0), "field 'seed' = 3.0 must be an integer >= 0"),
    "mode a number": (SHAPLEY3, _set("mode", 3), "field 'mode' = 3 must be a non-empty string"),
    "no protocol hash": (SHAPLEY3, _drop("protocol.hash"), "field 'protocol.hash' is missing"),
    "no start version": (SHAPLEY3, _drop("start.version"), "field 'start.version' is missing"),
    "start a string": (SHAPLEY3, _set("start", "d67b684cf777"), "field 'start' = 'd67b684cf777' must be an object"),
    "pins' flags": (SHAPLEY3, _set("pins.isa_flags", 3), "field 'pins.isa_flags' = 3 must be a list of strings"),
    "a start's ndcg": (START, _set("ndcg@10", 1.5, 9), "field 'ndcg@10'[9] = 1.5 is outside [0, 1]"),
    "a start's version": (START, _set("start.version", 5), "field 'start.version' = 5 must be a non-empty string"),
    "a start without claims": (START, _set("claims", []), "field 'claims' = [] must be a non-empty list of claim ids"),
    "unknown format": (START, _set("format", "casi-credit-start/9"), "is not a CASI credit-cell result (its 'format' is not casi-credit-cell/1, casi-credit-start/1)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(VALUES))
def test_an_impossible_value_is_refused_naming_the_file_and_field(case: str, folder: Path) -> None:
    """Before: ndcg@10 = 7.0 gave exit 0 and flipped a verdict; NaN, strings and missing keys
    ended in TypeError / KeyError far from the file."""
    name, change, problem = VALUES[case]
    _edit(folder / name, change)
    _refused(folder, f"{name}: {problem}" if problem.startswith("field") else f"{name} {problem}")


def test_a_file_that_is_not_json_is_one_line(folder: Path) -> None:
    (folder / SHAPLEY3).write_bytes(b'{"format": "caf\xe9"')
    with pytest.raises(
        ValueError, match=r"^main/shapley-seed3.json is not a readable result file: "
    ):
        aggregate(folder)


def _copy(folder: Path, src: str, dst: str) -> None:
    shutil.copy(folder / src, folder / dst)


def test_a_copy_under_another_name_is_refused_naming_both(folder: Path) -> None:
    """Before: shapley-seed3.v2.json silently replaced shapley-seed3.json."""
    _copy(folder, SHAPLEY3, "main/shapley-seed3.v2.json")
    _refused(folder, "main/shapley-seed3.json and main/shapley-seed3.v2.json hold the same cell "
             "shapley-seed3: keep only main/shapley-seed3.json")  # fmt: skip


def test_a_copy_over_another_seed_is_refused_naming_both(folder: Path) -> None:
    """Before: broadcast-seed1.json saved as broadcast-seed2.json made seed 2 "missing"."""
    _copy(folder, "main/broadcast-seed1.json", "main/broadcast-seed2.json")
    _refused(folder, "main/broadcast-seed1.json and main/broadcast-seed2.json hold the same cell "
             "broadcast-seed1: keep only main/broadcast-seed1.json")  # fmt: skip


def test_a_copy_over_another_mode_is_refused_naming_both(folder: Path) -> None:
    """Before: shapley-seed0.json copied to broadcast-seed0.json silently dropped a cell."""
    _copy(folder, "main/shapley-seed0.json", "main/broadcast-seed0.json")
    _refused(folder, "main/broadcast-seed0.json and main/shapley-seed0.json hold the same cell "
             "shapley-seed0: keep only main/shapley-seed0.json")  # fmt: skip


def test_a_file_named_other_than_what_it_holds_is_refused(folder: Path) -> None:
    (folder / SHAPLEY3).rename(folder / "main" / "shapley-seed3.v2.json")
    _refused(folder, "main/shapley-seed3.v2.json: holds cell shapley-seed3, so its name must be "
             "shapley-seed3.json")  # fmt: skip
    (folder / "main" / "shapley-seed3.v2.json").rename(folder / SHAPLEY3)
    (folder / START).rename(folder / "control" / "start-0123.json")
    _refused(folder, "control/start-0123.json: holds start d67b684cf777, so its name must be "
             "start-d67b684cf777.json")  # fmt: skip


def test_anything_else_in_an_environment_folder_is_refused(folder: Path) -> None:
    (folder / "main" / "notes.txt").write_text("seed 3 ran twice")
    _refused(folder, "main/notes.txt: not a result file; an environment's folder holds only "
             "<mode>-seed<K>.json and start-<version>.json files (move it elsewhere)")  # fmt: skip


def test_a_cell_whose_start_is_missing_is_refused(folder: Path) -> None:
    """Before: without start-476cc348e7ad.json the table still said "complete" and averaged
    the gain over start over 5 seeds of 6 under the full label."""
    (folder / "main" / "start-476cc348e7ad.json").unlink()
    _refused(folder, "main/broadcast-seed1.json: its start 476cc348e7ad has no evaluation in "
             "main/ (start-476cc348e7ad.json is missing): restore it, or run the cell's command "
             "again")  # fmt: skip


def test_a_seed_the_protocol_does_not_plan_is_refused(folder: Path) -> None:
    """Before: a seed-7 cell was aggregated and fed into the hypothesis tests."""
    _copy(folder, "main/shapley-seed5.json", "main/shapley-seed7.json")
    _edit(folder / "main" / "shapley-seed7.json", _set("seed", 7))
    _refused(folder, "main/shapley-seed7.json: seed 7 is outside the protocol's plan for main "
             "(seeds 0-5)")  # fmt: skip


def _relabel(mode: str | None = None, seed: int | None = None) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        if mode is not None:
            data["mode"] = mode
        if seed is not None:
            data["seed"] = seed

    return change


RELABELLED = {
    # a copy over a missing cell, its label edited: it had turned a partial verdict into "yes"
    "mode": ("main/broadcast-seed2.json", "main/shapley-seed2.json", _relabel(mode="shapley"),
             "main/shapley-seed2.json: its config was trained with credit 'broadcast', but the "
             "file says credit 'shapley': a cell's file holds what that cell trained"),
    "seed": ("main/shapley-seed0.json", "main/shapley-seed2.json", _relabel(seed=2),
             "main/shapley-seed2.json: its config was trained with seed 0, but the file says "
             "seed 2: a cell's file holds what that cell trained"),
    "seed and config": ("main/shapley-seed0.json", "main/shapley-seed2.json",
                        lambda d: (_relabel(seed=2)(d), _set("config.seed", 2)(d)),
                        "main/shapley-seed0.json and main/shapley-seed2.json end in the same "
                        "trained policy {final}: cells of different seeds never train the same "
                        "weights; one is a copy"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(RELABELLED))
def test_a_cell_relabelled_as_another_is_refused(case: str, folder: Path) -> None:
    src, dst, change, message = RELABELLED[case]
    (folder / dst).unlink()
    _copy(folder, src, dst)
    _edit(folder / dst, change)
    final = json.loads((folder / src).read_text(encoding="utf-8"))["final_version"]
    _refused(folder, message.format(final=final))


SETTINGS = {
    "another lr": (_set("config.update.lr", 0.5), "main/shapley-seed3.json: its config is not "
                   "the one the protocol gives shapley-seed3 (trained with other settings than "
                   "credit-units-v1's)"),
    "no config": (_drop("config"), "main/shapley-seed3.json: field 'config' is missing"),
    "a config list": (_set("config", []), "main/shapley-seed3.json: field 'config' = [] must be "
                      "an object (the cell's training config)"),
    "no final version": (_drop("final_version"), "main/shapley-seed3.json: field 'final_version' "
                         "is missing"),
    "a path as version": (_set("start.version", "../../d67b684cf777"), "main/shapley-seed3.json: "
                          "field 'start.version' = '../../d67b684cf777' is not a policy version "
                          "(6 to 64 hex digits)"),
    "no list_k pin": (_drop("pins.list_k"), "main/shapley-seed3.json: field 'pins.list_k' is "
                      "missing"),
    "another index": (_set("pins.index_version", "0123456789ab"), "main/shapley-seed3.json: "
                      "pins.index_version = '0123456789ab', but main/broadcast-seed0.json has "
                      "{index!r}: the files of main were made in different games"),
    "another depth": (_set("pins.retrieval_k", 20), "main/shapley-seed3.json: pins.retrieval_k = "
                      "20, but main/broadcast-seed0.json has {depth!r}: the files of main were "
                      "made in different games"),
    "another retriever": (_set("pins.retriever", "dense"), "main/shapley-seed3.json: "
                          "pins.retriever = 'dense', but environment main has {retriever!r}: the "
                          "file was made in another game"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SETTINGS))
def test_a_cell_made_with_other_settings_is_refused(case: str, folder: Path) -> None:
    """Before, none of these was looked at: a cell trained with another lr, on another index or
    depth (a machine with another CASI_RETRIEVAL_K), or without its config, was aggregated."""
    change, message = SETTINGS[case]
    pins = json.loads((folder / "main" / "broadcast-seed0.json").read_text())["pins"]
    _edit(folder / SHAPLEY3, change)
    _refused(folder, message.format(
        index=pins["index_version"], depth=pins["retrieval_k"], retriever=pins["retriever"]
    ))  # fmt: skip


def test_nothing_is_written_when_the_plot_fails(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: table.md was written first, then the plot raised (a step without reward_mean):
    a failed aggregate left a new table.md beside the old ndcg.png."""

    def broken(*_: Any) -> bytes:
        raise ValueError("the plot failed")

    monkeypatch.setattr(units_aggregate, "plot", broken)
    _refused(folder, "the plot failed")


def test_the_metric_of_the_protocol_is_the_one_compared(folder: Path) -> None:
    """`[analysis] metric = "recall@100"`: the hypotheses, the per-seed table and the gain use
    recall@100 (cells re-labelled with that protocol's hash; 200 resamples to keep it short)."""
    text = (folder / "protocol.toml").read_text(encoding="utf-8")
    text = text.replace("resamples = 10000", "resamples = 200")
    text = text.replace("margin = 0.005", 'margin = 0.005\nmetric = "recall@100"')
    (folder / "protocol.toml").write_text(text, encoding="utf-8")
    new_hash = protocol_hash(tomllib.loads(text))
    for path in folder.glob("*/*.json"):
        _edit(path, _set("protocol.hash", new_hash))
    result = aggregate(folder)
    cells = {(p.stem.split("-seed")[0], int(p.stem.split("-seed")[1])): json.loads(p.read_text())
             for p in (folder / "main").glob("*-seed*.json")}  # fmt: skip
    row = next(r for r in result["hypotheses"] if r["name"] == "shapley > broadcast")
    per_seed = [
        statistics.fmean(cells["shapley", s]["recall@100"])
        - statistics.fmean(cells["broadcast", s]["recall@100"])
        for s in range(6)
    ]
    np.testing.assert_allclose(row["per_seed_diff"], per_seed, rtol=0, atol=1e-12)
    a = np.array([cells["shapley", s]["recall@100"] for s in range(6)])
    b = np.array([cells["broadcast", s]["recall@100"] for s in range(6)])
    assert row["p"] == two_level_bootstrap(a, b, n_resamples=200, seed=0, level=0.95).p_one_sided
    table = (folder / "table.md").read_text(encoding="utf-8")
    # the compared metric first, then the others the cells hold (not recall@100 twice)
    assert "Per seed, recall@100:" in table
    assert "| credit | seeds | recall@100 | served nDCG@10 | gain over start |" in table


def test_holm_counts_every_pre_registered_member_and_waits_for_the_family(folder: Path) -> None:
    """Before: Holm's m was the number of family members with results, so a member with no
    cell yet shrank it (p̃ 0.0032 where m = 2 gives 0.0064), and a complete member's verdict
    showed as final while its family could still change it. Now the untested member enters
    with p = 1 and the complete members read "not yet (…; family … incomplete)"."""
    text = (folder / "protocol.toml").read_text(encoding="utf-8")
    text = text.replace("resamples = 10000", "resamples = 200")
    extra = (
        '\n[environments.later]\nretriever = "dense"\nmerge = "max"\nanchor = true\n'
        'n_actions = 4\nmodes = ["broadcast", "shapley"]\nseeds = 2\n'
    )
    first = text.index("[[hypotheses]]")
    text = text[:first] + extra.lstrip("\n") + "\n" + text[first:]
    text += (
        '\n[[hypotheses]]\nname = "later shapley > broadcast"\nenvironment = "later"\n'
        'a = "shapley"\nb = "broadcast"\nkind = "greater"\nfamily = "primary"\n'
    )
    (folder / "protocol.toml").write_text(text, encoding="utf-8")
    new_hash = protocol_hash(tomllib.loads(text))
    for path in folder.glob("*/*.json"):
        _edit(path, _set("protocol.hash", new_hash))
    result = aggregate(folder)
    rows = {r["name"]: r for r in result["hypotheses"]}
    primary = [rows["shapley > broadcast"], rows["shapley > singleton"]]
    assert "p" not in rows["later shapley > broadcast"]
    expected = units_aggregate.holm({**{r["name"]: r["p"] for r in primary}, "x": 1.0})
    for r in primary:
        assert r["p_holm"] == expected[r["name"]] and r["family_complete"] is False
    assert rows["shapley > shuffled"]["family_complete"] is True  # another family: final
    table = (folder / "table.md").read_text(encoding="utf-8")
    row = next(line for line in table.splitlines() if line.startswith("| shapley > broadcast |"))
    assert "| not yet (no; family primary incomplete) | none |" in row


def test_holm_rejects_at_alpha_itself(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """methods.md says a hypothesis holds when p̃ ≤ α; the aggregate compared p̃ < α, so a
    bootstrap p of exactly 0.025 in a family of two (p̃ = 0.05, a multiple of 1/resamples that
    happens) was 'no'."""
    greater = units_aggregate.HYPOTHESIS_TESTS["greater"]
    monkeypatch.setitem(
        units_aggregate.HYPOTHESIS_TESTS, "greater",
        dataclasses.replace(greater, p=lambda *_: 0.025),
    )  # fmt: skip
    rows = {r["name"]: r for r in aggregate(folder)["hypotheses"]}
    for name in ("shapley > broadcast", "shapley > singleton"):  # the primary family, m = 2
        assert rows[name]["p_holm"] == 0.05 and rows[name]["held"] is True


POOLED = ROOT / "docs" / "experiments" / "credit-pool"


def _pooled_copy(tmp_path: Path) -> Path:
    """A copy of the committed pooled results: protocol, cells, table.md and ndcg.png."""
    dst = tmp_path / "credit-pool"
    shutil.copytree(POOLED, dst, ignore=shutil.ignore_patterns("selection", "*.md", "*.json"))
    shutil.copytree(POOLED / "pool", dst / "pool", dirs_exist_ok=True)
    return dst


def test_the_committed_pooled_results_give_the_committed_table_byte_for_byte(
    tmp_path: Path,
) -> None:
    """The pooled experiment's table and plot are what its committed cells give, as they land."""
    dst = _pooled_copy(tmp_path)
    aggregate(dst)
    assert (dst / "table.md").read_bytes() == (POOLED / "table.md").read_bytes()
    assert (dst / "ndcg.png").read_bytes() == (POOLED / "ndcg.png").read_bytes()


def test_the_pooled_mechanism_table_is_the_cells_own(tmp_path: Path) -> None:
    """The pooled game's table says how each mode spends its budget: per mode the mean over
    seeds of its cells' held-out overlap, duplicate rate and share of the gain only one rewrite
    found, beside the start's own (the SciFact table, byte for byte above, has no such table)."""
    dst = _pooled_copy(tmp_path)
    aggregate(dst)
    table = (dst / "table.md").read_text(encoding="utf-8")
    section = table.split("How the rewrites spend the budget")[1].split("\n\n")[1]
    keys = ("overlap", "duplicate_rate", "unique_gain_share")
    for path in sorted((dst / "pool").glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        label = f"the start {data['start']['version']}" if "mode" not in data else data["mode"]
        row = next(line for line in section.splitlines() if line.startswith(f"| {label} | "))
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        seeds = (
            sorted((dst / "pool").glob(f"{data['mode']}-seed*.json")) if "mode" in data else [path]
        )
        metrics = [json.loads(p.read_text(encoding="utf-8"))["eval_metrics"] for p in seeds]
        for key, cell in zip(keys, cells, strict=True):
            values = [m[key] for m in metrics]
            assert cell.split(" ")[0] == f"{statistics.fmean(values):.4f}", (label, key, row)
    assert "How the rewrites spend the budget" not in (COMMITTED / "table.md").read_text()


def test_one_seed_has_no_sd(folder: Path) -> None:
    """A mode with one seed so far prints its mean and "± —", not "± 0.0000" (an sd of one
    value is not zero, it does not exist)."""
    for path in folder.glob("*/*-seed*.json"):
        if not path.stem.endswith("-seed0"):
            path.unlink()
    aggregate(folder)
    table = (folder / "table.md").read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("| shapley | 1 |")]
    assert rows and all("± —" in row and "± 0.0" not in row for row in rows), table


def test_write_json_uses_a_temporary_file_of_its_own(tmp_path: Path) -> None:
    """Before: every writer of `<name>.json` wrote `<name>.tmp` and renamed it: two writers of a
    cell shared (and renamed away) one temporary file."""
    path = tmp_path / "main" / "shapley-seed0.json"
    other = path.with_suffix(".tmp")  # what another writer of the same file had in progress
    other.parent.mkdir(parents=True)
    other.write_text("another writer's bytes")
    write_json(path, {"b": 1, "a": [0.5]})
    assert path.read_text() == '{\n "a": [\n  0.5\n ],\n "b": 1\n}\n'
    assert other.read_text() == "another writer's bytes"
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "shapley-seed0.json",
        "shapley-seed0.tmp",
    ]
