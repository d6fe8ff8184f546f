"""Audits through the REST API against a real server (tiny policy, SciFact slice, real Redis
and SQLite): an admin starts an audit job (a real `casi audit run --into ID` process) on a
stored run's actions, polls it to the end, reads the report JSON (valid against its schema)
and the HTML; users cannot start audits; bad input and failing jobs are clear."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from api_support import ApiServer, auth

from app.db import repositories as repo
from app.db import session_scope
from app.db.session import make_engine, make_session_factory
from app.reports.audit_json import validate_report
from app.workers import audit_jobs

pytestmark = pytest.mark.integration


def _stored_run(database_url: str, slice_path: Path) -> tuple[int, int]:
    """A training run with 3 queries × 2 credit records of real SciFact claims → (id, rows)."""
    import json

    lines = (slice_path / "qrels" / "train.tsv").read_text().splitlines()[1:]
    qids = list(dict.fromkeys(line.split("\t")[0] for line in lines))[:3]
    texts = {}
    for line in (slice_path / "queries.jsonl").read_text().splitlines():
        q = json.loads(line)
        if q["_id"] in qids:
            texts[q["_id"]] = q["text"]
    engine = make_engine(database_url)
    rows = []
    for q in qids:
        for s, actions in enumerate(
            ([texts[q], "zebra stripes"], [texts[q] + " evidence", "cells", "protein"])
        ):
            m = len(actions)
            rows.append({
                "step": 1, "query_id": q, "query_text": texts[q], "sample_index": s,
                "policy_version": "p" * 12, "actions": actions, "value_table": [0.0] * 2**m,
                "credits": [0.0] * m, "value_full": 0.0, "efficiency_residual": 0.0,
                "index_version": "i", "embedder_version": "e", "evaluator_name": "replay",
                "evaluator_version": "v", "anchor_query": True,
            })  # fmt: skip
    with session_scope(make_session_factory(engine)) as session:
        run = repo.create_run(session, name="audited", preset="casi", config={})
        repo.add_credit_records(session, [{**r, "run_id": run.id} for r in rows])
        run_id = run.id
    engine.dispose()
    return run_id, len(rows)


def _wait(fetch: Callable[[], dict], timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        body = fetch()
        if body["status"] not in ("queued", "running"):
            return body
        time.sleep(0.5)
    raise AssertionError(f"audit still pending after {timeout}s: {body}")


def test_audit_job_end_to_end(
    server: ApiServer, client: httpx.Client, keys: dict[str, str], slice_path: Path
) -> None:
    admin, user = auth(keys["admin"]), auth(keys["user"])
    run_id, n_rows = _stored_run(server.env["DATABASE_URL"], slice_path)
    body = {"evaluator": "cosine", "from_run": run_id, "n_boot": 100}

    assert client.post("/v1/audits", json=body, headers=user).status_code == 403
    bad = client.post("/v1/audits", json={**body, "evaluator": "surrogate"}, headers=admin)
    assert bad.status_code == 422 and "available: ['cosine', 'replay']" in bad.json()["message"]
    unknown = client.post("/v1/audits", json={**body, "evaluator": "bm25"}, headers=admin)
    assert unknown.status_code == 422 and unknown.json()["field"] == "body.evaluator"
    same = client.post("/v1/audits", json={**body, "evaluator": "replay"}, headers=admin)
    assert same.status_code == 422 and "both the reference and a training" in same.json()["message"]
    assert client.post("/v1/audits", json={**body, "queries": 0}, headers=admin).status_code == 422

    started = client.post("/v1/audits", json=body, headers=admin)
    assert started.status_code == 202, started.text
    job = started.json()
    assert job["status"] in ("queued", "running", "finished") and job["train_evaluator"] == "cosine"
    done = _wait(lambda: client.get(f"/v1/audits/{job['id']}", headers=user).json())
    assert done["status"] == "finished", (done, server.log()[-3000:])
    assert done["verdict"] in ("agrees", "partial", "disagrees") and done["n_rollouts"] == n_rows
    report = done["report"]
    validate_report(report)
    assert report["meta"]["source"] == "run" and report["meta"]["run_id"] == run_id
    assert report["meta"]["anchor_query"] is True and report["n_queries"] == 3
    assert done["agreement_by_size"] == [s["agree"] for s in report["sizes"]]
    assert done["report_url"] == f"/v1/audits/{job['id']}/report"

    html = client.get(done["report_url"], headers=user)
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert html.text.startswith("<!doctype html>") and 'id="plot-agreement"' in html.text
    listed = client.get("/v1/audits", headers=user).json()
    assert job["id"] in [a["id"] for a in listed["items"]] and listed["limit"] == 50


def _frozen(client: httpx.Client, headers: dict[str, str], response: httpx.Response) -> dict:
    """The started audit (202 asserted), its process group stopped (SIGSTOP) at once. An audit
    of a stored run of 6 rows ends within seconds of starting; frozen before it has imported
    anything, it holds its job slot until it is cancelled (SIGKILL ends a stopped process), so
    the cap and the cancels below do not race the audits' own ends on a slow machine."""
    assert response.status_code == 202, response.text
    audit = response.json()
    pid = client.get(f"/v1/audits/{audit['id']}", headers=headers).json()["report"]["pid"]
    os.killpg(pid, signal.SIGSTOP)
    return audit


def test_an_audit_is_cancelled_and_frees_its_slot(
    server: ApiServer, client: httpx.Client, keys: dict[str, str], slice_path: Path
) -> None:
    """Issue 27 item 4: `POST /v1/audits/{id}/cancel` was a 404. A quick audit by default
    (20 claims × 2 samples), the full one on request; cancel = the training jobs' cancel."""
    admin, user = auth(keys["admin"]), auth(keys["user"])
    run_id, _ = _stored_run(server.env["DATABASE_URL"], slice_path)
    body = {"evaluator": "cosine", "from_run": run_id, "n_boot": 100}
    started: list[dict] = []
    try:
        _cancel_and_free_slot(server, client, admin, user, body, started)
    finally:  # a failure above leaves no audit holding a slot for the tests after it
        for audit in started:
            client.post(f"/v1/audits/{audit['id']}/cancel", headers=admin)


def _cancel_and_free_slot(
    server: ApiServer, client: httpx.Client, admin: dict[str, str], user: dict[str, str],
    body: dict, started: list[dict],
) -> None:  # fmt: skip
    def start(extra: dict) -> dict:
        started.append(
            _frozen(client, admin, client.post("/v1/audits", json={**body, **extra}, headers=admin))
        )
        return started[-1]

    quick, full = start({}), start({"size": "full"})
    over = client.post("/v1/audits", json=body, headers=admin)  # CASI_API_MAX_RUNNING_JOBS=2
    assert over.status_code == 409, (over.text, server.log()[-3000:])
    assert "CASI_API_MAX_RUNNING_JOBS" in over.json()["message"]
    detail = lambda i: client.get(f"/v1/audits/{i}", headers=user).json()  # noqa: E731
    requests = [detail(a["id"])["report"]["request"] for a in (quick, full)]
    assert [(r["queries"], r["samples"]) for r in requests] == [(20, 2), (100, 4)]
    pid = detail(quick["id"])["report"]["pid"]
    assert quick["status"] == "running" and audit_jobs.process_alive(pid, quick["id"])

    assert client.post(f"/v1/audits/{quick['id']}/cancel", headers=user).status_code == 403
    cancelled = client.post(f"/v1/audits/{quick['id']}/cancel", headers=admin)
    assert cancelled.status_code == 200, cancelled.text
    out = cancelled.json()
    assert out["id"] == quick["id"] and out["status"] == "cancelled"
    assert out["verdict"] == "cancelled" and out["error"] == "cancelled by request"
    assert out["report_url"] is None and set(out) == set(quick)  # the audit's own shape
    assert not audit_jobs.process_alive(pid, quick["id"])  # its process group ended
    again = client.post(f"/v1/audits/{quick['id']}/cancel", headers=admin)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"  # idempotent

    explicit = start({"queries": 7, "samples": 3})  # the slot is free; explicit sizes win
    request = detail(explicit["id"])["report"]["request"]
    assert (request["queries"], request["samples"]) == (7, 3)
    for audit in (full, explicit):
        assert client.post(f"/v1/audits/{audit['id']}/cancel", headers=admin).status_code == 200
    time.sleep(1.0)  # the watchers see the killed processes: the state stays cancelled
    assert {detail(a["id"])["status"] for a in (quick, full, explicit)} == {"cancelled"}
    unknown = client.post("/v1/audits/99999/cancel", headers=admin)
    assert unknown.status_code == 404 and unknown.json()["error"] == "not_found"


def test_failing_job_and_missing_audit(
    server: ApiServer, client: httpx.Client, keys: dict[str, str]
) -> None:
    admin = auth(keys["admin"])
    assert client.get("/v1/audits/99999", headers=admin).status_code == 404
    unknown = client.post(  # a run that does not exist: refused before a job starts
        "/v1/audits", json={"evaluator": "cosine", "from_run": 99999}, headers=admin
    )
    assert unknown.status_code == 404 and unknown.json()["field"] == "body.from_run"
    engine = make_engine(server.env["DATABASE_URL"])
    try:  # a run with nothing to audit: the job starts, then fails saying why
        with session_scope(make_session_factory(engine)) as session:
            run_id = repo.create_run(session, name="empty-run", preset="casi", config={}).id
    finally:
        engine.dispose()
    started = client.post(
        "/v1/audits", json={"evaluator": "cosine", "from_run": run_id}, headers=admin
    )
    assert started.status_code == 202, started.text
    failed = _wait(lambda: client.get(f"/v1/audits/{started.json()['id']}", headers=admin).json())
    assert failed["status"] == "failed" and "has no credit records" in failed["error"]
    report = client.get(f"/v1/audits/{failed['id']}/report", headers=admin)
    assert report.status_code == 409 and report.json()["error"] == "conflict"
    late = client.post(f"/v1/audits/{failed['id']}/cancel", headers=admin)  # it ended: 409
    assert late.status_code == 409 and "is already failed" in late.json()["message"]
