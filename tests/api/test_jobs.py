"""Training jobs end to end with a REAL `casi train` (tiny policy, SciFact slice), on
PostgreSQL when it is reachable (else SQLite): start → list → cancel (the process group is
gone); a short job finishes with its step metrics; job state survives an API restart, and a
worker killed behind the API's back is reported as failed, never as running."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from api_support import ApiServer, auth, make_key, server_env

pytestmark = pytest.mark.integration
TINY_JOB = {"preset": "casi", "queries": 1, "samples": 2, "n_actions": 2,
            "eval_queries": 0, "checkpoint_every": 0}  # fmt: skip


@pytest.fixture()
def job_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    try:
        url: str = request.getfixturevalue("pg_schema_url")
        return url
    except pytest.skip.Exception:  # no PostgreSQL here (CI always has one: it fails there)
        return f"sqlite:///{tmp_path / 'casi.db'}"


@pytest.fixture()
def make_server(
    job_db_url: str, tmp_path: Path, api_var: Path, slice_path: Path, redis_url: str,
    tiny_policies: list[Path],
) -> Iterator[Callable[[], ApiServer]]:  # fmt: skip
    env = server_env(var=api_var, dataset=slice_path, database_url=job_db_url,
                     redis_url=redis_url, policy=tiny_policies[0])  # fmt: skip
    started: list[ApiServer] = []

    def start() -> ApiServer:
        srv = ApiServer(env, tmp_path / f"server{len(started)}.log").start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def wait_for(fetch: Callable[[], dict], done: Callable[[dict], bool], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = fetch()
        if done(body):
            return body
        time.sleep(0.3)
    raise AssertionError(f"timed out; last: {body}")


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def run_status(srv: ApiServer, run_id: int) -> str:
    """The training run's status, read straight from the server's database."""
    from sqlalchemy import text

    from app.db.session import make_engine

    engine = make_engine(srv.env["DATABASE_URL"])
    try:
        with engine.connect() as conn:
            return str(
                conn.execute(
                    text("SELECT status FROM training_runs WHERE id = :i"), {"i": run_id}
                ).scalar_one()
            )
    finally:
        engine.dispose()


def start_job(c: httpx.Client, key: str, **extra: object) -> dict:
    policy = c.get("/v1/policies", headers=auth(key)).json()["active_version"]
    r = c.post("/v1/train-jobs", json={**TINY_JOB, "policy": policy, **extra}, headers=auth(key))
    assert r.status_code == 201, r.text
    return r.json()


def test_job_started_listed_cancelled_and_finished(make_server: Callable[[], ApiServer]) -> None:
    srv = make_server()
    admin = make_key(srv.env["DATABASE_URL"], "admin")
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        long = start_job(c, admin, steps=10_000)
        second = start_job(c, admin, steps=10_000)  # CASI_API_MAX_RUNNING_JOBS=2: the cap
        over = c.post("/v1/train-jobs", json={**TINY_JOB, "steps": 1}, headers=auth(admin))
        assert over.status_code == 409 and "CASI_API_MAX_RUNNING_JOBS" in over.json()["message"]
        # audits count against the same cap (seen: a fuzz run started ten audits at once)
        audit = c.post("/v1/audits", json={"evaluator": "cosine"}, headers=auth(admin))
        assert audit.status_code == 409 and "CASI_API_MAX_RUNNING_JOBS" in audit.json()["message"]
        c.post(f"/v1/train-jobs/{second['id']}/cancel", headers=auth(admin))
        assert long["status"] == "running" and long["run_name"] == f"job-{long['id']}"
        assert pid_alive(long["pid"])
        listed = c.get("/v1/train-jobs", headers=auth(admin)).json()["items"]
        assert [j["id"] for j in listed] == [second["id"], long["id"]]
        get = lambda: c.get(f"/v1/train-jobs/{long['id']}", headers=auth(admin)).json()  # noqa: E731
        wait_for(get, lambda j: j["run_id"] is not None)  # the trainer registered its run

        cancelled = c.post(f"/v1/train-jobs/{long['id']}/cancel", headers=auth(admin))
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled" and cancelled.json()["finished_at"]
        assert not pid_alive(long["pid"])
        again = c.post(f"/v1/train-jobs/{long['id']}/cancel", headers=auth(admin))
        assert again.status_code == 200 and again.json()["status"] == "cancelled"  # idempotent
        assert run_status(srv, long["run_id"] or get()["run_id"]) == "cancelled"  # not `running`

        short = start_job(c, admin, steps=1)
        done = wait_for(lambda: c.get(f"/v1/train-jobs/{short['id']}", headers=auth(admin)).json(),
                        lambda j: j["status"] != "running")  # fmt: skip
        assert done["status"] == "finished", (done, Path(srv.env["CASI_VAR_DIR"]).name)
        assert done["exit_code"] == 0 and done["step"] is not None
        assert run_status(srv, done["run_id"]) == "finished"
        finished = c.post(f"/v1/train-jobs/{short['id']}/cancel", headers=auth(admin))
        assert finished.status_code == 409 and finished.json()["error"] == "conflict"
        assert "reward_mean" in (done["latest_metrics"] or {})
        statuses = {
            j["id"]: j["status"]
            for j in c.get("/v1/train-jobs", headers=auth(admin)).json()["items"]
        }
        assert statuses == {
            long["id"]: "cancelled",
            second["id"]: "cancelled",
            short["id"]: "finished",
        }
        running = c.get("/v1/train-jobs?status=running", headers=auth(admin)).json()["items"]
        assert running == []


def test_job_survives_restart_and_dead_worker_is_failed(
    make_server: Callable[[], ApiServer],
) -> None:
    first = make_server()
    admin = make_key(first.env["DATABASE_URL"], "admin")
    with httpx.Client(base_url=first.url, timeout=60) as c:
        job = start_job(c, admin, steps=10_000)
    first.stop()  # the API goes away; the trainer (its own session) keeps running
    assert pid_alive(job["pid"])

    second = make_server()
    with httpx.Client(base_url=second.url, timeout=60) as c:
        get = lambda: c.get(f"/v1/train-jobs/{job['id']}", headers=auth(admin)).json()  # noqa: E731
        assert get()["status"] == "running"  # state came from the database
        os.killpg(job["pid"], signal.SIGKILL)  # the worker dies behind the API's back
        failed = wait_for(get, lambda j: j["status"] != "running", timeout=30)
        assert failed["status"] == "failed" and "gone" in failed["error"]
        assert run_status(second, failed["run_id"]) == "failed"  # the run ended with its job
        listed = c.get("/v1/train-jobs?status=running", headers=auth(admin)).json()["items"]
        assert listed == []


def test_unknown_policy_is_404_and_a_failed_job_names_no_server_path(
    make_server: Callable[[], ApiServer],
) -> None:
    """Issue 38, item 16: a job naming an unknown policy got 201 and failed 10 s later
    (docs/api.md promises a 404 naming body.policy); a failed job's `error` gave the path of
    its log on the server to any user-scope key."""
    srv = make_server()
    admin = make_key(srv.env["DATABASE_URL"], "admin")
    user = make_key(srv.env["DATABASE_URL"], "user")
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        unknown = {**TINY_JOB, "steps": 1, "policy": "abcdef0123456789"}
        r = c.post("/v1/train-jobs", json=unknown, headers=auth(admin))
        assert r.status_code == 404, r.text
        assert r.json()["field"] == "body.policy" and "abcdef0123456789" in r.json()["message"]
        assert c.get("/v1/train-jobs", headers=auth(admin)).json()["items"] == []  # none recorded

        # no surrogate was fitted on this server's var dir: refused before a job starts (it
        # was accepted, and the trainer stopped with exit 2 seconds later)
        r = c.post(
            "/v1/train-jobs", json={**TINY_JOB, "evaluator": "surrogate"}, headers=auth(admin)
        )
        assert r.status_code == 422 and r.json()["field"] == "body.evaluator", r.text
        assert c.get("/v1/train-jobs", headers=auth(admin)).json()["items"] == []  # none recorded

        # a prefix names the version it is the prefix of, and the job is stored with that version
        active = c.get("/v1/policies", headers=auth(admin)).json()["active_version"]
        job = start_job(c, admin, steps=1, policy=active[:8])
        assert job["overrides"]["policy"] == active
        os.killpg(job["pid"], signal.SIGKILL)  # the trainer dies (killed, out of memory, ...)
        get = lambda: c.get(f"/v1/train-jobs/{job['id']}", headers=auth(user)).json()  # noqa: E731
        failed = wait_for(get, lambda j: j["status"] != "running")
        assert failed["status"] == "failed" and failed["exit_code"] == -signal.SIGKILL, failed
        assert f"job-{job['id']}.log" in failed["error"], failed["error"]
        for path in (srv.env["CASI_VAR_DIR"], "/jobs/", "/"):
            assert path not in failed["error"], failed["error"]
