"""An attacker's review of the API and the dashboard (in-process, on a real SQLite database and,
for the admission lock, PostgreSQL when reachable): the latency histogram's series stay bounded
whatever method a client sends; concurrent wrong keys are counted before their look-ups finish;
the key is checked before a body is parsed; the running-jobs cap holds across API processes and
dead or stale audits never hold a slot; a version whose weights cannot be loaded is a 409; a
diverged job's NaN metrics are null; a form with too many fields is a 4xx; an evaluator the
server lacks and a run that does not exist are refused before a job starts; every 404 of a job
or an audit names its path parameter.

The app is `create_app` with a built state put in place by hand (no lifespan: no index, no
policy); the routes under test need only the database, the job runner and the limiters.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from app.api.metrics import Metrics
from app.api.ratelimit import FailureLimiter, RateLimiter
from app.api.state import AppState
from app.db import repositories as repo
from app.db import session_scope
from app.db.models import AuditReport, TrainJob, utcnow
from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.errors import InvalidField, JobConflict
from app.main import create_app
from app.schemas_ops import TrainJobRequest
from app.services.keys import create_key
from app.settings import Settings
from app.workers.jobs import JobRunner, active_jobs
from evaluator.cache import CacheStats

DEAD_PID = 2**22 + 12345  # above the default pid_max: no such process
JSON = {"content-type": "application/json"}


@pytest.fixture()
def db(tmp_path: Path) -> Iterator[tuple[Engine, sessionmaker[Session]]]:
    url = f"sqlite:///{tmp_path / 'casi.db'}"
    upgrade_to_head(url)
    engine = make_engine(url)
    yield engine, make_session_factory(engine)
    engine.dispose()


def built_app(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path, *, failures_per_min: float = 0,
    rate: tuple[float, int] = (0, 1), max_running: int = 1,
) -> tuple[FastAPI, AppState, dict[str, str]]:  # fmt: skip
    """The app with a state built by hand (replay and cosine scorers, no surrogate), and an
    admin and a user key."""
    engine, factory = db
    settings = Settings(var_dir=tmp_path / "var", api_max_running_jobs=max_running)
    state = AppState(
        settings=settings, engine=engine, factory=factory, retrieval=None,  # type: ignore[arg-type]
        scorers=dict.fromkeys(("replay", "cosine")),  # type: ignore[arg-type]
        batcher=SimpleNamespace(policy=SimpleNamespace(version="0" * 12)),  # type: ignore[arg-type]
        jobs=JobRunner(factory, tmp_path / "jobs"), metrics=None,  # type: ignore[arg-type]
        limiter=RateLimiter(*rate), auth_failures=FailureLimiter(failures_per_min),
    )  # fmt: skip
    app = create_app(settings)
    app.state.casi = state
    keys = {scope: create_key(factory, scope, scope)[1] for scope in ("admin", "user")}
    return app, state, keys


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(r: Any, status: int, field: str | None) -> dict[str, Any]:
    """``r``: an httpx response (TestClient's or httpx's)."""
    assert r.status_code == status, r.text
    body: dict[str, Any] = r.json()
    assert body["field"] == field and body["message"], body
    return body


# --- 1. the latency histogram --------------------------------------------------------------


def test_latency_histogram_names_only_standard_methods() -> None:
    app = create_app(Settings())
    metrics = Metrics(CacheStats())
    app.state.casi = SimpleNamespace(metrics=metrics)
    client = TestClient(app, raise_server_exceptions=False)
    for i in range(40):
        client.request(f"X{i:06d}", "/no/such/path")
    client.request("GET", "/no/such/path")
    text = metrics.render().decode()
    methods = set(re.findall(r'casi_http_request_duration_seconds_count\{method="([^"]+)"', text))
    assert methods == {"GET", "other"}, methods


# --- 3. wrong keys in flight are counted ----------------------------------------------------


async def _concurrently(app: FastAPI, requests: list[dict[str, Any]]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
        return await asyncio.gather(*(c.request(**r) for r in requests))


def test_concurrent_wrong_keys_are_counted_before_their_lookups(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path
) -> None:
    """150 concurrent wrong keys from one address against a limit of 30 a minute: at most the
    30 (and what refills meanwhile) are looked up and answered 401, the rest 429. Checking the
    limit first and recording failures after let all 150 through."""
    app, _, _ = built_app(db, tmp_path, failures_per_min=30)
    wrong = [
        {"method": "GET", "url": "/v1/train-jobs", "headers": bearer(f"casi_guess{i}")}
        for i in range(150)
    ]
    codes = [r.status_code for r in asyncio.run(_concurrently(app, wrong))]
    assert set(codes) == {401, 429}, codes
    assert codes.count(401) <= 32, codes.count(401)


def test_a_valid_key_gives_its_attempt_back(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path
) -> None:
    """A valid key's attempt is given back, and a key known valid takes none: a client's 20
    concurrent requests with its own key pass a limit of 5, and leave the budget whole."""
    app, _, keys = built_app(db, tmp_path, failures_per_min=5)
    c = TestClient(app)
    assert c.get("/v1/train-jobs", headers=bearer(keys["user"])).status_code == 200
    good = [{"method": "GET", "url": "/v1/train-jobs", "headers": bearer(keys["user"])}] * 20
    assert {r.status_code for r in asyncio.run(_concurrently(app, good))} == {200}
    codes = [c.get("/v1/train-jobs", headers=bearer(f"casi_x{i}")).status_code for i in range(6)]
    assert codes == [401] * 5 + [429]  # the valid keys took nothing from the wrong-key budget
    assert c.get("/v1/train-jobs", headers=bearer(keys["user"])).status_code == 429  # blocked


def test_concurrent_wrong_keys_on_the_login_form_are_counted(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path
) -> None:
    app, _, _ = built_app(db, tmp_path, failures_per_min=10)
    c = TestClient(app)
    form = c.get("/ui/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert csrf is not None
    cookie = "; ".join(f"{k}={v}" for k, v in c.cookies.items())
    posts = [
        {"method": "POST", "url": "/ui/login", "headers": {"cookie": cookie},
         "data": {"key": f"casi_guess{i}", "csrf": csrf.group(1)}}
        for i in range(40)
    ]  # fmt: skip
    codes = [r.status_code for r in asyncio.run(_concurrently(app, posts))]
    assert set(codes) == {401, 429}, codes
    assert codes.count(401) <= 11, codes.count(401)


# --- 10. the key before the body ------------------------------------------------------------


def test_the_key_is_checked_before_the_body_is_parsed(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path
) -> None:
    app, _, keys = built_app(db, tmp_path, failures_per_min=2, rate=(0.001, 1))
    c = TestClient(app)
    broken = b'{"queries": ['
    r = c.post("/v1/rewrites", content=broken, headers=JSON)
    assert_error(r, 401, "header.Authorization")
    assert r.headers["www-authenticate"] == "Bearer"
    for i in range(2):  # wrong keys with a malformed body are counted
        r = c.post("/v1/rewrites", content=broken, headers={**JSON, **bearer(f"casi_wrong{i}")})
        assert_error(r, 401, "header.Authorization")
    r = c.post("/v1/audits", content=broken, headers={**JSON, **bearer("casi_wrong9")})
    assert_error(r, 429, "header.Authorization")

    app, _, keys = built_app(db, tmp_path, rate=(0.001, 1))  # a fresh limiter, one request
    c = TestClient(app)
    h = {**JSON, **bearer(keys["admin"])}
    assert_error(c.post("/v1/credits", content=broken, headers=h), 422, "body")
    r = c.post("/v1/credits", content=broken, headers=h)  # the key's rate before the body
    assert_error(r, 429, "header.Authorization")


# --- 11. 404s name the path parameter ---------------------------------------------------------


def test_unknown_jobs_and_audits_name_the_path_parameter(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path
) -> None:
    app, _, keys = built_app(db, tmp_path)
    c = TestClient(app)
    admin = bearer(keys["admin"])
    assert_error(c.get("/v1/train-jobs/999", headers=admin), 404, "path.job_id")
    assert_error(c.post("/v1/train-jobs/999/cancel", headers=admin), 404, "path.job_id")
    assert_error(c.post("/v1/audits/999/cancel", headers=admin), 404, "path.audit_id")
    assert_error(c.get("/v1/audits/999", headers=admin), 404, "path.audit_id")


# --- 9. what the server lacks is refused before a job starts ----------------------------------


def _rows(factory: sessionmaker[Session]) -> tuple[int, int]:
    with session_scope(factory) as s:
        return len(s.scalars(select(TrainJob)).all()), len(s.scalars(select(AuditReport)).all())


def test_an_evaluator_or_run_the_server_lacks_is_refused_before_the_job(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path
) -> None:
    app, state, keys = built_app(db, tmp_path, max_running=1)
    c = TestClient(app)
    admin = bearer(keys["admin"])
    with session_scope(state.factory) as s:  # a fresh queued job holds a slot: nothing starts
        repo.create_train_job(s, preset="casi", overrides={})
    before = _rows(state.factory)
    r = c.post("/v1/train-jobs", json={"preset": "casi", "evaluator": "surrogate"}, headers=admin)
    body = assert_error(r, 422, "body.evaluator")
    assert "surrogate" in body["message"] and "cosine" in body["message"]
    r = c.post("/v1/audits", json={"evaluator": "cosine", "from_run": 4242}, headers=admin)
    assert_error(r, 404, "body.from_run")
    assert _rows(state.factory) == before  # nothing recorded
    with pytest.raises(InvalidField, match="evaluator"):  # the dashboard's start, the same
        state.jobs.start(
            TrainJobRequest(preset="casi", evaluator="surrogate"), evaluators=state.scorers
        )


# --- 4. / 5. admission: one transaction under a database lock; dead audits free their slot ---


def _race_admissions(factories: list[sessionmaker[Session]], tmp_path: Path) -> int:
    """Two JobRunners (two API processes: each its own engine and thread lock), cap 1, two
    simultaneous starts; the number of queued jobs afterwards."""
    runners = [JobRunner(f, tmp_path / "jobs") for f in factories]
    barrier = threading.Barrier(len(runners))

    def go(runner: JobRunner) -> None:
        barrier.wait()
        try:
            with runner.admission(1) as session:
                repo.create_train_job(session, preset="casi", overrides={})
        except JobConflict:
            pass

    threads = [threading.Thread(target=go, args=(r,)) for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    with session_scope(factories[0]) as s:
        count = active_jobs(s)
        for job in s.scalars(select(TrainJob)).all():
            s.delete(job)
    return count


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_api_processes_cannot_both_take_the_last_slot(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'casi.db'}"
    else:
        url = request.getfixturevalue("pg_schema_url")
    upgrade_to_head(url)
    engines = [make_engine(url), make_engine(url)]
    try:
        factories = [make_session_factory(e) for e in engines]
        counts = [_race_admissions(factories, tmp_path) for _ in range(15)]
    finally:
        for e in engines:
            e.dispose()
    assert counts == [1] * 15, counts


def test_dead_and_stale_jobs_and_audits_free_their_slots_at_admission(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path
) -> None:
    """Two audits left `running` by a process that died, one queued long ago that never got
    a process, and a training job whose process is gone: none of them holds a slot."""
    _, factory = db
    old = utcnow() - timedelta(minutes=10)
    with session_scope(factory) as s:
        ids = []
        for report, verdict in (
            ({"status": "running", "pid": DEAD_PID, "request": {}}, "running"),
            ({"status": "running", "pid": DEAD_PID + 1, "request": {}}, "running"),
            ({"status": "queued", "request": {}}, "queued"),
        ):
            row = repo.add_audit_report(s, train_evaluator="cosine", reference_evaluator="replay",
                                        n_rollouts=0, report=report, verdict=verdict)  # fmt: skip
            row.created_at = old
            ids.append(row.id)
        job = repo.create_train_job(s, preset="casi", overrides={})
        job.status, job.pid, job.run_name = "running", DEAD_PID, f"job-{job.id}"
    runner = JobRunner(factory, tmp_path / "jobs")
    with runner.admission(1) as session:
        new = repo.create_train_job(session, preset="casi", overrides={}).id
    with session_scope(factory) as s:
        assert [s.get(AuditReport, i).verdict for i in ids] == ["failed"] * 3  # type: ignore[union-attr]
        errors = [s.get(AuditReport, i).report["error"] for i in ids]  # type: ignore[union-attr]
        assert errors[2] == "never started" and "gone" in errors[0]
        assert s.get(TrainJob, job.id).status == "failed"  # type: ignore[union-attr]
        assert active_jobs(s) == 1 and s.get(TrainJob, new) is not None
    with pytest.raises(JobConflict), runner.admission(1):  # and the cap still holds
        pass


# --- 6. weights that cannot be loaded ---------------------------------------------------------


def test_activating_a_version_whose_weights_are_missing_or_damaged_is_409(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path
) -> None:
    app, state, keys = built_app(db, tmp_path)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text('{"model_type": "llama"}')
    (damaged / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    with session_scope(state.factory) as s:
        for version, path in (("deadbeef0001", tmp_path / "gone"), ("deadbeef0002", damaged)):
            repo.add_policy_version(s, version=version, name="x", base_model="x", path=str(path),
                                    kind="base")  # fmt: skip
    c = TestClient(app, raise_server_exceptions=False)
    for version in ("deadbeef0001", "deadbeef0002"):
        r = c.post(f"/v1/policies/{version}/activate", headers=bearer(keys["admin"]))
        body = assert_error(r, 409, "path.version")
        assert version in body["message"] and str(tmp_path) not in body["message"]
    assert state.batcher.policy.version == "0" * 12  # still serving the old one
    op = app.openapi()["paths"]["/v1/policies/{version}/activate"]["post"]
    assert "409" in op["responses"] and "weights" in op["responses"]["409"]["description"]


# --- 7. NaN metrics ---------------------------------------------------------------------------


def _ui_login(c: TestClient, key: str) -> None:
    form = c.get("/ui/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert csrf is not None
    r = c.post("/ui/login", data={"key": key, "csrf": csrf.group(1)}, follow_redirects=False)
    assert r.status_code == 303, r.text


def test_a_diverged_jobs_nan_metrics_are_null(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path
) -> None:
    app, state, keys = built_app(db, tmp_path)
    with session_scope(state.factory) as s:
        job = repo.create_train_job(s, preset="casi", overrides={})
        job.status, job.run_name = "failed", f"job-{job.id}"
        s.flush()
        run = repo.create_run(s, name=job.run_name, preset="casi", config={})
        repo.add_step_metrics(s, run.id, 1, {"loss": math.nan, "grad_norm": -math.inf, "r": 0.5})
        job_id = job.id
    c = TestClient(app, raise_server_exceptions=False)
    expected = {"loss": None, "grad_norm": None, "r": 0.5}
    r = c.get(f"/v1/train-jobs/{job_id}", headers=bearer(keys["user"]))
    assert r.status_code == 200 and r.json()["latest_metrics"] == expected, r.text
    _ui_login(c, keys["user"])
    r = c.get(f"/ui/jobs/{job_id}/live")
    assert r.status_code == 200, r.text
    assert r.json()["metrics"] == expected and r.json()["shown"]["loss"] == "—"
    schema = app.openapi()["components"]["schemas"]["TrainJobOut"]["properties"]["latest_metrics"]
    values = schema["anyOf"][0]["additionalProperties"]
    assert {"type": "null"} in values["anyOf"], values


# --- 2. forms with too many fields ------------------------------------------------------------


def test_a_form_with_too_many_fields_is_400(
    db: tuple[Engine, sessionmaker[Session]], tmp_path: Path
) -> None:
    app, _, keys = built_app(db, tmp_path)
    c = TestClient(app, raise_server_exceptions=False)
    fields = {f"f{i}": "x" for i in range(80)}
    r = c.post("/ui/login", data=fields)
    assert r.status_code == 400 and "too many form fields" in r.text, r.text[:300]
    _ui_login(c, keys["admin"])
    r = c.post("/ui/jobs", data=fields)
    assert r.status_code == 400 and "too many form fields" in r.text, r.text[:300]
