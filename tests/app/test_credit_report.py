"""`casi audit credits`: where do the credits differ? On the SciFact slice with real Redis, the
real dense and bm25 indexes and the tiny format policy: every (retriever, merge, m, anchor)
game is measured on the same rollouts and equals a direct `compute_credits` +
`credit_differences` of that game; stored rollouts are measured at their own m; the command
writes its table, Markdown and JSON (a subprocess on a slice corpus)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.reports.credit_differences import DEFINITIONS, rollout_sources, to_markdown, write_report
from app.runtime import Retrieval
from app.services.audit import Rollouts, load_rollouts, save_rollouts
from app.services.credit_report import (
    ENVIRONMENTS,
    CreditReportRequest,
    credit_report,
    rollout_source,
)
from app.training.policy_loader import LoadedPolicy
from evaluator.actions import ActionExecutor
from evaluator.cache import ActionCache
from evaluator.credit import RolloutActions, compute_credits
from evaluator.credit_diff import RANK_KEYS, credit_differences
from evaluator.retrievers import RetrieverSpec, build_retriever
from evaluator.scorers import make_scorer
from policy.model import policy_version

CASI = str(Path(sys.executable).with_name("casi"))


@pytest.fixture()
def retrievals(
    slice_dataset, embedder, var_dir, slice_retrieval, redis_client
) -> dict[str, Retrieval]:  # type: ignore[no-untyped-def]
    index, _ = build_retriever("bm25", RetrieverSpec(slice_dataset.documents, var_dir))
    cache = ActionCache(redis_client, index.version, index.encoder_version, 10)
    bm25 = Retrieval(
        slice_dataset, embedder, index, cache, ActionExecutor(embedder, index, cache),  # type: ignore[arg-type]
        False, redis_client,
    )  # fmt: skip
    return {"dense": slice_retrieval, "bm25": bm25}


def _stored_rollouts(dataset: Any, path: Path) -> Path:
    """Three-action rollouts of the slice's test claims: word windows of the claim, a repeat,
    and junk — so some games change v and some actions interact."""
    actions = []
    for q in dataset.split_query_ids("test"):
        words = dataset.queries[q].split()
        for shift in (0, 2):
            acts = [" ".join(words[shift : shift + 3]), " ".join(words[shift + 3 :]), "zebra"]
            actions.append(RolloutActions(q, dataset.queries[q], acts))
    save_rollouts(Rollouts(actions, 3, True, {"source": "test", "split": "test"}), path)
    return path


def test_every_game_on_the_same_sampled_rollouts(
    format_policy, smol_tokenizer, retrievals, slice_dataset
) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(format_policy)
    pol = LoadedPolicy(
        model, smol_tokenizer, policy_version(model), "format", "tiny", "tiny", "base"
    )
    loads: list[str | None] = []
    scorer = make_scorer("replay", qrels=slice_dataset.qrels_rows("test"), k=10)
    request = CreditReportRequest(
        n_actions=(2, 4), queries=3, samples=2, line_cap=4, batch_queries=3
    )
    seen: list[tuple[int, int]] = []
    report = credit_report(
        request, retrievals, scorer, 10,
        load_policy=lambda ref: loads.append(ref) or pol, progress=lambda n, t: seen.append((n, t)),
    )  # fmt: skip
    assert loads == [None]  # one policy load for every m
    assert seen[-1] == (6, 6)  # progress over both m
    rows = report["rows"]
    assert len(rows) == 2 * len(ENVIRONMENTS) * 2
    assert {(r["retriever"], r["merge"]) for r in rows} == set(ENVIRONMENTS)
    assert {r["m"] for r in rows} == {2, 4} and {r["anchor"] for r in rows} == {True, False}
    assert (
        report["rollouts"]["4"]["n_rollouts"] == 6 and report["rollouts"]["4"]["format_ok"] == 1.0
    )
    for r in rows:
        assert r["n_rollouts"] == 6 and r["actions_mean"] == r["m"]  # constrained: exactly m
        assert 0.0 <= r["v_full_changes"] <= r["v_any_changes"] <= 1.0
        assert r["v_full_changes"] == r["n_gain"] / r["n_rollouts"]
        for credit in ("singleton", "leave_one_out"):
            strict, tie = r[f"{credit}_rank_reversed_strict"], r[f"{credit}_rank_differs_tie_aware"]
            assert 0.0 <= strict <= tie <= 1.0
        for key in RANK_KEYS:  # every rollout has m ≥ 2 actions: ranked = all
            assert r[f"{key}_of_ranked"] == r[key]
        assert r["gain_mean"] == pytest.approx(r["v_full_mean"] - r["v_empty_mean"])
        if not r["anchor"]:
            assert r["v_empty_mean"] == 0.0  # the empty coalition retrieves nothing
    anchored = [r for r in rows if r["anchor"] and r["m"] == 2]
    assert (
        len({r["v_empty_mean"] for r in anchored if r["retriever"] == "dense"}) == 1
    )  # ∅ = query alone
    assert report["indexes"] == {n: r.index.version for n, r in retrievals.items()}
    assert report["machine"]["cpu_model"]
    md = to_markdown(report)
    assert md.count("\n| dense |") == 8 and "| bm25 | rrf (k=60) | 4 | off |" in md
    assert (
        f"- m = 4: 6 rollouts of 3 test claims, sampled from policy format (version {pol.version}), "
        "constrained format, format_ok 100.0 %." in md
    )
    assert all(f"- {definition}\n" in md for definition in DEFINITIONS)


def test_a_row_is_that_game_measured_directly(retrievals, slice_dataset, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = _stored_rollouts(slice_dataset, tmp_path / "rollouts.json")
    scorer = make_scorer("replay", qrels=slice_dataset.qrels_rows("test"), k=10)
    request = CreditReportRequest(
        n_actions=(3, 8), from_rollouts=str(path), rrf_k=20.0,
        environments=(("bm25", "rrf"), ("dense", "max")),
    )  # fmt: skip
    report = credit_report(request, retrievals, scorer, 10)
    assert report["skipped_m"] == [8] and set(report["rollouts"]) == {"3"}
    row = next(r for r in report["rows"] if r["retriever"] == "bm25" and not r["anchor"])
    stored = json.loads(path.read_text())["rollouts"]
    acts = [RolloutActions(r["query_id"], r["query_text"], r["actions"]) for r in stored]
    res = compute_credits(
        acts, retrievals["bm25"].executor, scorer, 10, anchor_query=False, merge="rrf", rrf_k=20.0
    )
    direct = credit_differences(res.values, res.n_actions).as_dict()
    assert {k: row[k] for k in direct} == direct
    assert row["gain_mean"] == pytest.approx(float((res.values[:, -1] - res.values[:, 0]).mean()))
    md, js = write_report(report, tmp_path / "out", "credit-differences")
    assert json.loads(js.read_text())["rows"] == report["rows"]
    assert "Not measured: m = [8]" in md.read_text()
    with pytest.raises(ValueError, match="pass one of them"):
        CreditReportRequest(from_rollouts=str(path), policy="warmstart")
    with pytest.raises(ValueError, match="with --split test"):
        credit_report(
            CreditReportRequest(n_actions=(3,), from_rollouts=str(path), split="val"),
            retrievals, scorer, 10,
        )  # fmt: skip


def test_the_report_names_the_policy_that_sampled_stored_rollouts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Bug (review): the table of docs/audits/scifact-test-rollouts.json was described as the warm
    start's; those rollouts are the untrained SmolLM2's, free-format, 46 % well-formed. The
    report now says so from the file's own metadata (saved before the format was recorded)."""
    meta = {
        "source": "sampled", "policy_version": "63b72c62c3d5", "split": "test",
        "policy_name": "SmolLM2-135M-Instruct", "format_ok": 0.4625,
    }  # fmt: skip
    path = tmp_path / "old-rollouts.json"
    save_rollouts(Rollouts([RolloutActions("1", "q", ["a", "b"])], 4, True, meta), path)
    source = rollout_source(load_rollouts(path))
    assert source["format"] == "free" and source["format_recorded"] is False
    assert source["n_rollouts"] == 1 and source["n_queries"] == 1
    (line,) = rollout_sources({"rollouts": {"4": source}})
    assert line == (
        "m = 4: 1 rollouts of 1 test claims, sampled from policy SmolLM2-135M-Instruct (version "
        "63b72c62c3d5), free format (not recorded; inferred: sampled before the constrained "
        f"format existed), format_ok 46.2 %; stored in {path}"
    )
    recorded = rollout_source(Rollouts([], 4, True, {**meta, "format": "constrained"}))
    assert recorded["format"] == "constrained" and recorded["format_recorded"] is True


def test_retrievers_must_index_the_same_documents(retrievals, slice_dataset) -> None:  # type: ignore[no-untyped-def]
    other = SimpleNamespace(
        **{
            **retrievals["bm25"].__dict__,
            "dataset": SimpleNamespace(documents=slice_dataset.documents[1:]),
        }
    )
    scorer = make_scorer("replay", qrels=slice_dataset.qrels_rows("test"), k=10)
    with pytest.raises(ValueError, match="index different documents"):
        credit_report(
            CreditReportRequest(), {"dense": retrievals["dense"], "bm25": other}, scorer, 10
        )  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="no retrieval stack"):
        credit_report(CreditReportRequest(), {"dense": retrievals["dense"]}, scorer, 10)
    with pytest.raises(ValueError, match="unknown merge"):
        CreditReportRequest(environments=(("bm25", "sum"),))


def _casi(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CASI, *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_command_on_stored_rollouts(slice_path, slice_dataset, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = _stored_rollouts(slice_dataset, tmp_path / "rollouts.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASI_")}
    env.update(
        DATABASE_URL=f"sqlite:///{tmp_path / 'casi.db'}", CASI_VAR_DIR=str(tmp_path / "var"),
        CASI_DATASET=str(slice_path), COLUMNS="250", CASI_DEVICE="cpu",
    )  # fmt: skip
    bad = _casi("audit", "credits", "--env", "bm25-rrf", env=env)
    errors = [line for line in (bad.stdout + bad.stderr).splitlines() if line.startswith("error:")]
    assert bad.returncode == 2 and len(errors) == 1 and "RETRIEVER:MERGE" in errors[0]
    out = tmp_path / "out"
    res = _casi(
        "audit", "credits", "--from-rollouts", str(path), "--n-actions", "3", "8",
        "--anchor", "on", "--out", str(out), env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "where do the credits differ" in res.stdout and "not measured: m = [8]" in res.stdout
    report = json.loads((out / "credit-differences.json").read_text())
    assert [(r["retriever"], r["merge"]) for r in report["rows"]] == list(ENVIRONMENTS)
    assert all(r["anchor"] and r["m"] == 3 and r["n_rollouts"] == 16 for r in report["rows"])
    assert (out / "credit-differences.md").read_text().startswith("# Where do the credits differ?")
