"""`casi eval --run-file`: the held-out lists as a TREC run file (``qid Q0 docid rank score tag``).

On the SciFact slice with BM25 actions fused by rrf (the game where the served top 10 and the
top 10 of the depth-100 fusion differ) and the tiny format policy: the file parses, every claim
has its lists under the documented tags, ranks run 1..n with strictly descending scores, the
lines are the lists the evaluation scored, and nDCG@10 / recall@100 recomputed from the file —
by CASI's function and by trec_eval — equal the evaluation's. Then the command itself, end to
end, against what it stored. Real model, real index, real Redis and SQLite; nothing mocked.
"""

from __future__ import annotations

import copy
import os
import stat
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytrec_eval
from typer.testing import CliRunner

from app.cli import app
from app.db import repositories as repo
from app.db import session_scope
from app.db.session import make_engine, make_session_factory
from app.runtime import Retrieval
from app.settings import get_settings
from app.training.evaluate import build_eval_request, run_tags, write_trec_run
from app.training.splits import split_ids
from evaluator.actions import ActionExecutor
from evaluator.cache import ActionCache
from evaluator.corpus import load_dataset
from evaluator.retrieval_eval import ndcg_recall_at_k
from evaluator.retrievers import RetrieverSpec, build_retriever
from policy.evaluate import LISTS, EvalConfig, evaluate_policy
from policy.model import save_checkpoint
from policy.rollout import RolloutConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hardening"))
from hardening_support import read_only  # noqa: E402

TAGS = {"query", "rewrites", "combined", "query-100", "rewrites-100", "combined-100"}
N_CLAIMS = 5
Parsed = dict[str, dict[str, list[tuple[str, int, float]]]]  # tag → qid → (doc, rank, score)


def parse_run(path: Path) -> Parsed:
    """Parse a TREC run file strictly: 6 fields, Q0, integer rank, float score."""
    out: Parsed = defaultdict(lambda: defaultdict(list))
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fields = line.split()
        assert len(fields) == 6 and fields[1] == "Q0", f"line {number}: {line!r}"
        qid, _, doc, rank, score, tag = fields
        out[tag][qid].append((doc, int(rank), float(score)))
    return out


def check_shape(parsed: Parsed, qids: list[str]) -> None:
    assert set(parsed) == TAGS
    for tag, by_query in parsed.items():
        assert set(by_query) <= set(qids), tag
        if not tag.startswith("rewrites"):  # the claim's own list is never empty here
            assert set(by_query) == set(qids), tag
        for qid, lines in by_query.items():
            ranks = [rank for _, rank, _ in lines]
            scores = [score for _, _, score in lines]
            docs = [doc for doc, _, _ in lines]
            assert ranks == list(range(1, len(lines) + 1)), (tag, qid)
            assert all(a > b for a, b in zip(scores, scores[1:], strict=False)), (tag, qid)
            assert len(set(docs)) == len(docs), (tag, qid)
            assert len(lines) <= (100 if tag.endswith("-100") else 10), (tag, qid)


def recomputed(parsed: Parsed, qids: list[str], rels: dict[str, dict[int, int]], doc_ids: list[str]) -> dict[str, float]:  # fmt: skip
    """The evaluation's metrics, from the file alone: nDCG@10 on the served tags, recall@100
    on the -100 tags (mean over every claim; a claim without lines counts 0)."""
    row = {d: i for i, d in enumerate(doc_ids)}
    out = {}
    for name in LISTS:
        ndcg = [ndcg_recall_at_k([row[d] for d, _, _ in parsed[name].get(q, [])], rels[q], 10)[0] for q in qids]  # fmt: skip
        recall = [ndcg_recall_at_k([row[d] for d, _, _ in parsed[f"{name}-100"].get(q, [])], rels[q], 100)[1] for q in qids]  # fmt: skip
        out[f"{name}_ndcg@10"] = sum(ndcg) / len(qids)
        out[f"{name}_recall@100"] = sum(recall) / len(qids)
    return out


def by_trec_eval(parsed: Parsed, qids: list[str], qrels: dict[str, dict[str, int]]) -> dict[str, float]:  # fmt: skip
    """The same means by trec_eval, which re-sorts each run by its score column."""
    out = {}
    for name in LISTS:
        for tag, measure, key in ((name, "ndcg_cut.10", "ndcg_cut_10"), (f"{name}-100", "recall.100", "recall_100")):  # fmt: skip
            run = {q: {d: s for d, _, s in parsed[tag].get(q, [])} for q in qids}  # empty: 0
            got = pytrec_eval.RelevanceEvaluator(qrels, {measure}).evaluate(run)
            metric = "ndcg@10" if measure.startswith("ndcg") else "recall@100"
            out[f"{name}_{metric}"] = sum(got[q][key] for q in qids) / len(qids)
    return out


@pytest.fixture()
def bm25_retrieval(slice_dataset, embedder, var_dir, redis_client) -> Retrieval:  # type: ignore[no-untyped-def]
    index, _ = build_retriever("bm25", RetrieverSpec(slice_dataset.documents, var_dir))
    cache = ActionCache(redis_client, index.version, index.encoder_version, 10)
    ex = ActionExecutor(embedder, index, cache)
    assert ex.merge == "rrf"
    return Retrieval(slice_dataset, embedder, index, cache, ex, False, redis_client)  # type: ignore[arg-type]


def test_run_file_holds_the_lists_the_evaluation_scored(
    format_policy: Any, smol_tokenizer: Any, bm25_retrieval: Retrieval, tmp_path: Path
) -> None:
    r = bm25_retrieval
    request = build_eval_request(
        r, "test", N_CLAIMS, EvalConfig(RolloutConfig(n_actions=2, line_cap=10))
    )
    res = evaluate_policy(
        copy.deepcopy(format_policy), smol_tokenizer, request.queries, request.executor,
        request.ndcg, request.recall, request.config, recall_executor=request.recall_executor,
    )  # fmt: skip
    path = tmp_path / "run.txt"
    n_lines = write_trec_run(path, res, r.retriever.doc_ids, request.config)
    assert set(run_tags(request.config)) == TAGS
    parsed = parse_run(path)
    qids = [q for q, _ in request.queries]
    check_shape(parsed, qids)
    assert sum(len(v) for by_q in parsed.values() for v in by_q.values()) == n_lines

    # the lines are the evaluation's lists, in its order
    for tag, (key, i) in run_tags(request.config).items():
        for q, qid in enumerate(qids):
            rows = [x for x in res.lists[key].rows[q, i].tolist() if x >= 0]
            assert [d for d, _, _ in parsed[tag].get(qid, [])] == [
                r.retriever.doc_ids[x] for x in rows
            ]
    # the written score is the fused float32 score; ties go down by float32 ulps, nothing more
    for q, qid in enumerate(qids):
        fused = res.lists["recall"].scores[q, 2].double().tolist()
        written = [s for _, _, s in parsed["combined-100"][qid]]
        assert all(0 <= f - w < 1e-6 for w, f in zip(written, fused, strict=False))
        assert all(float(np.float32(w)) == w for w in written)  # float32 values, exactly
    ties = sum(
        len(set(s)) < len(s)
        for key in ("ndcg", "recall")
        for s in (res.lists[key].scores[q, i][res.lists[key].rows[q, i] >= 0].tolist()
                  for q in range(len(qids)) for i in range(3))
    )  # fmt: skip
    assert ties > 0  # rrf ties happen: the strict order of the file is exercised

    rels = r.dataset.qrels_rows("test")
    metrics = recomputed(parsed, qids, rels, r.retriever.doc_ids)
    trec = by_trec_eval(parsed, qids, {q: dict(r.dataset.qrels["test"][q]) for q in qids})
    for key, value in metrics.items():
        assert value == pytest.approx(res.metrics[key], abs=1e-12), key
        assert trec[key] == pytest.approx(res.metrics[key], abs=1e-6), key


def test_casi_eval_writes_the_run_file_it_scored(
    format_policy: Any,
    smol_tokenizer: Any,
    slice_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The command end to end (BM25, rrf): the file's nDCG@10 / recall@100 are the stored ones."""
    folder = save_checkpoint(format_policy, smol_tokenizer, tmp_path / "policy")
    var = tmp_path / "var"
    env = {"CASI_VAR_DIR": str(var), "CASI_DATASET": str(slice_path), "CASI_RETRIEVER": "bm25",
           "CASI_DEVICE": "cpu", "CASI_BM25_STEMMER": "none"}  # fmt: skip
    for name in ("DATABASE_URL", "REDIS_URL", "CASI_MAX_DOCS", "CASI_MERGE"):
        monkeypatch.delenv(name, raising=False)
    for name, setting in env.items():
        monkeypatch.setenv(name, setting)
    runner = CliRunner()
    get_settings.cache_clear()
    path = tmp_path / "run.txt"  # an existing private file: replaced, its mode (and owner) kept
    path.write_text("stale\n")
    path.chmod(0o600)
    owner = (4321, 4321) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    os.chown(path, *owner)
    try:
        missing = runner.invoke(app, ["eval", "--run-file", str(tmp_path / "nowhere" / "r.txt")])
        assert missing.exit_code == 2 and "does not exist" in missing.output
        args = ["eval", "--policy", str(folder), "--queries", "3", "--n-actions", "2",
                "--line-cap", "10", "--run-file", str(path)]  # fmt: skip
        done = runner.invoke(app, args, catch_exceptions=False)
    finally:
        get_settings.cache_clear()
    assert done.exit_code == 0, done.output
    assert f"TREC run file {path}" in done.output.replace("\n", "")
    st = path.stat()  # issue 38, item 10: it was 644 (and root's) after the write
    assert stat.S_IMODE(st.st_mode) == 0o600 and (st.st_uid, st.st_gid) == owner
    assert not list(tmp_path.glob(".run.txt.*"))  # no temporary file left beside it
    engine = make_engine(f"sqlite:///{(var / 'casi.db').as_posix()}")
    try:
        with session_scope(make_session_factory(engine)) as session:
            (pv,) = repo.list_policy_versions(session, limit=10)
            (stored,) = repo.evaluations_for_policy(session, pv.id)
            metrics: dict[str, Any] = dict(stored.metrics)
            assert stored.n_queries == 3 and stored.config["merge"] == "rrf"
    finally:
        engine.dispose()

    ds = load_dataset(slice_path)
    qids = split_ids(ds, "test")[:3]
    parsed = parse_run(path)
    check_shape(parsed, qids)
    got = recomputed(parsed, qids, ds.qrels_rows("test"), ds.doc_ids)
    for key, value in got.items():
        assert value == pytest.approx(metrics[key], abs=1e-12), key


def _refused(tmp_path: Path, target: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``casi eval --run-file target``: exit 2 and one ``error:`` line before any work. The
    database URL is unusable, so a command that did not check the target first fails on it
    (another message) instead of evaluating, and writes nothing."""
    monkeypatch.setenv("CASI_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("DATABASE_URL", "nope://")
    get_settings.cache_clear()
    try:
        got = CliRunner().invoke(app, ["eval", "--queries", "1", "--run-file", str(target)])
    finally:
        get_settings.cache_clear()
    errors = [line for line in got.output.splitlines() if line.startswith("error:")]
    assert got.exit_code == 2 and len(errors) == 1, got.output
    assert errors[0].startswith(f"error: --run-file {target}: "), errors[0]
    assert not (tmp_path / "var" / "casi.db").exists()  # nothing ran
    return errors[0]


def test_run_file_refuses_what_is_not_a_regular_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38, item 10: a device, a pipe or a symbolic link at the path was replaced by a
    regular file (as root, --run-file /dev/null would replace /dev/null; a link was replaced
    and its target left as it was). Each is refused in one line and left as it was."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert "is a named pipe, not a regular file" in _refused(tmp_path, pipe, monkeypatch)
    assert stat.S_ISFIFO(pipe.lstat().st_mode)

    target, link = tmp_path / "target.txt", tmp_path / "link.txt"
    target.write_text("keep\n")
    link.symlink_to(target)
    line = _refused(tmp_path, link, monkeypatch)
    assert f"is a symbolic link (to {target})" in line
    assert link.is_symlink() and target.read_text() == "keep\n"

    if os.geteuid() == 0:  # a /dev/null of our own (major 1, minor 3): only root may make one
        null = tmp_path / "null"
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        assert "is a character device" in _refused(tmp_path, null, monkeypatch)
        assert stat.S_ISCHR(null.lstat().st_mode)


def test_run_file_in_an_unwritable_folder_fails_before_the_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38, item 10: an unwritable target failed only after the whole evaluation, naming
    an internal temporary file. The folder is checked first, and the line names it."""
    folder = tmp_path / "ro"
    folder.mkdir()
    with read_only(folder):
        line = _refused(tmp_path, folder / "run.txt", monkeypatch)
    assert f"the folder {folder} is not writable" in line and ".tmp-" not in line
    assert not list(folder.iterdir())
