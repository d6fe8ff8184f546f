"""Fixtures of the dashboard tests: ONE real API (`create_app`, its real lifespan: database
migrated, the slice's retrieval stack, replay scorer, a tiny served policy) run by uvicorn in a
thread on a free loopback port, on PostgreSQL when reachable (else SQLite) and real Redis;
seeded through `app.db.repositories` (tests/ui/ui_seed.py). Keys: one user, one admin.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from ui_support import UiServer, _app_conftest, make_settings  # noqa: E402


@pytest.fixture(scope="session")
def ui_policies(smol_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from policy.model import build_tiny_policy, save_checkpoint

    root = tmp_path_factory.mktemp("ui-policies")
    return [save_checkpoint(build_tiny_policy(smol_tokenizer, seed=s), smol_tokenizer, root / f"tiny{s}")
            for s in (0, 1)]  # fmt: skip


@pytest.fixture(scope="session")
def ui_redis_url(request: pytest.FixtureRequest) -> str:
    url = os.environ.get("REDIS_URL")
    if url:
        return url
    client = request.getfixturevalue("_embedded_redis")
    return f"unix://{client.socket_file}"


@pytest.fixture(scope="session")
def ui_database_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh PostgreSQL schema when a server answers, else a SQLite file."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    conf = _app_conftest()
    url, _ = conf._first_reachable(tuple(conf.pg_candidate_urls()))
    if url is None:
        yield f"sqlite:///{tmp_path_factory.mktemp('ui-db') / 'casi.db'}"
        return
    admin_url = conf.normalize_url(url)
    schema = f"ui_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield admin_url.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False
        )
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(scope="session")
def ui_var(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ui-var")


@pytest.fixture(scope="session")
def ui_server(
    ui_var: Path, slice_path: Path, ui_database_url: str, ui_redis_url: str, ui_policies: list[Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[UiServer, Any]]:  # fmt: skip
    """The seeded server and what was seeded (`ui_seed.Seeded`)."""
    import ui_seed

    srv = UiServer(
        make_settings(ui_var, slice_path, ui_database_url, ui_redis_url, ui_policies[0])
    ).start()
    try:
        seeded = ui_seed.seed(
            srv.state, ui_policies[1], tmp_path_factory.mktemp("ui-logs"), ui_seed.audit_report()
        )
        yield srv, seeded
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def ui_keys(ui_server: tuple[UiServer, Any]) -> dict[str, str]:
    from app.services.keys import create_key

    factory = ui_server[0].state.factory
    return {scope: create_key(factory, f"ui-{scope}", scope)[1] for scope in ("user", "admin")}
