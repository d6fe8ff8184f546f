"""`check_database` fails fast, in one line naming the (redacted) URL and what to do, on real
SQLite files and a real PostgreSQL; the error boundary's translation table and redaction;
the default index slice that `casi index build` remembers."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hardening_support import free_port, truncate
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from app.db.session import check_database, normalize_url, upgrade_to_head
from app.errors import CasiError, DatabaseProblem, explain, redact


def _sqlite_file(path: Path) -> str:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x TEXT)")
    conn.executemany("INSERT INTO t VALUES (?)", [("x" * 300,)] * 300)
    conn.commit()
    conn.close()
    return f"sqlite:///{path}"


def test_sound_and_fresh_sqlite_pass(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new' / 'casi.db'}"
    check_database(url)  # absent: created by the migration
    upgrade_to_head(url)
    check_database(url)
    upgrade_to_head(url)  # idempotent, under its lock


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        ("garbled", "not a database"),
        ("truncated", "damaged"),
        ("folder", "is a folder"),
        ("foreign-revision", "does not know"),
        ("garbage-url", "not a database URL"),
        ("unknown-dialect", "unsupported database URL"),
    ],
)
def test_sqlite_and_url_problems_are_one_line(damage: str, fragment: str, tmp_path: Path) -> None:
    db = tmp_path / "casi.db"
    url = f"sqlite:///{db}"
    if damage == "garbled":
        db.write_bytes(b"garbage!" * 512)
    elif damage == "truncated":
        _sqlite_file(db)
        truncate(db)
    elif damage == "folder":
        db.mkdir()
    elif damage == "foreign-revision":
        upgrade_to_head(url)
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE alembic_version SET version_num = 'abcdef123456'")
    elif damage == "garbage-url":
        url = "::not a url::"
    else:
        url = "oracle+nothing://u:pw@host/db"
    with pytest.raises(DatabaseProblem) as info:
        check_database(url)
    line = info.value.line()
    assert fragment in line and " — " in line and "\n" not in line


@pytest.mark.integration
def test_postgres_not_listening_is_redacted(tmp_path: Path) -> None:
    url = f"postgresql://casi:topsecret@127.0.0.1:{free_port()}/casi"
    with pytest.raises(DatabaseProblem) as info:
        check_database(url)
    line = info.value.line()
    assert "cannot connect" in line and "topsecret" not in line and "***" in line


@pytest.mark.integration
def test_postgres_at_a_foreign_revision(pg_url: str) -> None:
    admin = create_engine(normalize_url(pg_url), poolclass=NullPool)
    schema = "t_hardening_foreign"
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        conn.execute(text(f'CREATE TABLE "{schema}".alembic_version (version_num varchar(32))'))
        conn.execute(text(f"INSERT INTO \"{schema}\".alembic_version VALUES ('0999_future')"))
    url = normalize_url(pg_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        with pytest.raises(DatabaseProblem, match="0999_future"):
            check_database(url.render_as_string(hide_password=False))
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def test_redact_hides_passwords_only() -> None:
    text_in = (
        "postgresql+psycopg://alice:p%40ss@db:5432/x and redis://:pw@r:6379/0 password=hunter2"
    )
    out = redact(text_in)
    assert "p%40ss" not in out and ":pw@" not in out and "hunter2" not in out
    assert "alice:***@db:5432" in out and "redis://:***@r" in out
    assert redact("sqlite:///var/casi.db") == "sqlite:///var/casi.db"


def test_explain_knows_the_library_failures(tmp_path: Path) -> None:
    import json as json_mod

    from evaluator.corpus import DatasetError

    assert explain(RuntimeError("bug")) is None
    ds = explain(DatasetError("unknown query id 'q7'", "qrels/train.tsv:3"))
    assert isinstance(ds, CasiError) and ds.line().startswith(
        "unknown query id 'q7' (qrels/train.tsv:3) — "
    )
    try:
        (tmp_path / "missing" / "x").read_text()
    except OSError as exc:
        assert "x" in explain(exc).line()  # type: ignore[union-attr]
    try:
        json_mod.loads("{")
    except ValueError as exc:
        assert explain(exc) is not None


def test_index_build_slice_is_the_default_of_later_commands(tmp_path: Path) -> None:
    from app.runtime import remember_default_index, resolve_max_docs
    from app.settings import Settings

    settings = Settings(var_dir=tmp_path / "var")
    data = tmp_path / "data"
    data.mkdir()
    assert resolve_max_docs(settings, data, None) is None  # nothing built: the whole corpus
    remember_default_index(settings, data, 500)  # what `make demo-list`'s index build records
    assert resolve_max_docs(settings, data, None) == 500
    assert resolve_max_docs(settings, data, 40) == 40  # --max-docs wins
    assert resolve_max_docs(settings, tmp_path / "other", None) is None  # another dataset
    assert resolve_max_docs(Settings(var_dir=tmp_path / "var", max_docs=7), data, None) == 7
    (tmp_path / "var" / "index" / "default.json").write_text("{garbled")
    assert resolve_max_docs(settings, data, None) is None
    remember_default_index(settings, data, None)  # a full build becomes the default
    assert json.loads((tmp_path / "var" / "index" / "default.json").read_text())["max_docs"] is None
