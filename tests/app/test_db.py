"""The database layer on real SQLite and PostgreSQL: migrations, model/migration parity,
repository round trips, constraints and API-key hashing. Fixtures: tests/app/conftest.py."""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime, timedelta

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import CheckConstraint, Engine, inspect, text
from sqlalchemy.exc import IntegrityError, StatementError
from sqlalchemy.orm import Session

from app.db import repositories as repo
from app.db.models import ApiKey, Base, PolicyKind, RunStatus
from app.db.session import (
    alembic_config,
    downgrade_to_base,
    is_at_head,
    make_engine,
    make_session_factory,
    session_scope,
    upgrade_to_head,
)

CASI_TABLES = {
    "policy_versions",
    "training_runs",
    "step_metrics",
    "credit_records",
    "audit_reports",
    "api_keys",
}


def _schema_diff(engine: Engine) -> list:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(context, Base.metadata)


def _tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def _credit_record(run_id: int | None, step: int | None, query_id: str, sample: int) -> dict:
    return {
        "run_id": run_id,
        "step": step,
        "query_id": query_id,
        "query_text": "does vitamin D reduce fractures?",
        "sample_index": sample,
        "policy_version": "a" * 64,
        "actions": ["vitamin D fracture risk", "calcitriol bone density"],
        "format_status": "ok",
        "value_table": [0.0, 0.25, 0.5, 0.875],
        "credits": [0.3125, 0.5625],
        "baselines": {
            "singleton": [0.25, 0.5],
            "leave_one_out": [0.375, 0.625],
            "broadcast": [0.4375, 0.4375],
        },
        "advantages": {"base": 0.125, "shaped": [-0.0625, 0.0625]},
        "value_full": 0.875,
        "efficiency_residual": 1e-17,
        "index_version": "idx-1",
        "embedder_version": "emb-1",
        "evaluator_name": "replay",
        "evaluator_version": "ev-1",
        "cache_stats": {"hits": 1, "misses": 1},
    }


# --- migrations -----------------------------------------------------------------------


def test_upgrade_downgrade_upgrade(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        upgrade_to_head(db_url)
        assert CASI_TABLES <= _tables(engine)
        assert is_at_head(engine)

        downgrade_to_base(db_url)
        assert not CASI_TABLES & _tables(engine)
        assert not is_at_head(engine)
        assert _schema_diff(engine), "an empty database must differ from the models"

        upgrade_to_head(db_url)
        upgrade_to_head(db_url)  # idempotent
        assert CASI_TABLES <= _tables(engine)
        assert is_at_head(engine)
    finally:
        engine.dispose()


def _rows(engine: Engine) -> dict[str, list[tuple[object, ...]]]:
    queries = {
        "credit_records": "SELECT id, run_id FROM credit_records",
        "step_metrics": "SELECT id, run_id FROM step_metrics",
        "policy_versions": "SELECT id, parent_id FROM policy_versions ORDER BY id",
        "runs": "SELECT id, policy_version_id, status FROM training_runs",
    }
    with engine.connect() as c:
        return {name: [tuple(r) for r in c.execute(text(q))] for name, q in queries.items()}


def test_an_upgrade_keeps_the_rows_of_a_populated_database(db_url: str) -> None:
    """On SQLite, batch mode rebuilt training_runs and policy_versions and DROPped the old ones
    with foreign keys on: every credit record and step metric was deleted (ON DELETE CASCADE)
    and the links set to NULL, silently, at the first start of a newer CASI. The migrations now
    run with foreign keys off on SQLite. A downgrade maps cancelled runs to failed (0001 has no
    cancelled) instead of failing half-way."""
    command.upgrade(alembic_config(db_url), "0001")
    engine = make_engine(db_url)
    try:
        with engine.begin() as c:
            for statement in (
                "INSERT INTO policy_versions (version, name, base_model, path, step, kind, meta) "
                "VALUES ('v1', 'n', 'b', 'p', 0, 'base', '{}')",
                "INSERT INTO policy_versions (version, name, base_model, path, step, kind, meta, "
                "parent_id) VALUES ('v2', 'n', 'b', 'p', 1, 'trained', '{}', 1)",
                "INSERT INTO training_runs (name, preset, config, status, policy_version_id) "
                "VALUES ('r', 'p', '{}', 'finished', 1)",
                "INSERT INTO step_metrics (run_id, step, metrics) VALUES (1, 1, '{}')",
                "INSERT INTO credit_records (run_id, step, query_id, query_text, sample_index, "
                "policy_version, actions, format_status, value_table, credits, value_full, "
                "efficiency_residual, index_version, embedder_version, evaluator_name, "
                "evaluator_version) VALUES (1, 1, 'q', 't', 0, 'v1', '[]', 'ok', '[]', '[]', 0, 0, "
                "'i', 'e', 'n', 'v')",
            ):
                c.execute(text(statement))
        before = _rows(engine)
        engine.dispose()
        upgrade_to_head(db_url)
        assert _rows(engine) == before
        with engine.begin() as c:
            c.execute(text("UPDATE training_runs SET status = 'cancelled'"))
        engine.dispose()
        command.downgrade(alembic_config(db_url), "0001")
        after = _rows(engine)
        assert after["runs"] == [(1, 1, "failed")]
        assert {k: v for k, v in after.items() if k != "runs"} == {
            k: v for k, v in before.items() if k != "runs"
        }
    finally:
        engine.dispose()


def test_models_match_migrations(db_engine: Engine) -> None:
    assert _schema_diff(db_engine) == []


def _checks(named: dict[str, str]) -> dict[str, list[str]]:
    """CHECK constraints by name, each as the sorted values it allows (PostgreSQL reflects
    ``x IN ('a', 'b')`` as ``(x)::text = ANY (ARRAY['a'::text, ...])``: the literals agree)."""
    return {name: sorted(set(re.findall(r"'([^']*)'", text))) for name, text in named.items()}


def test_migrations_create_the_models_check_constraints(db_engine: Engine) -> None:
    """Alembic's autogenerate compare does not look at CHECK constraints: a status or kind the
    models allow and a migration forgot would pass `test_models_match_migrations` and fail
    only at the first insert of that value in production."""
    inspector = inspect(db_engine)
    for name, table in Base.metadata.tables.items():
        model = {
            c.name: str(c.sqltext) for c in table.constraints if isinstance(c, CheckConstraint)
        }
        migrated = {c["name"]: c["sqltext"] for c in inspector.get_check_constraints(name)}
        assert _checks(migrated) == _checks(model), name
    assert (
        "cancelled"
        in _checks(
            {c["name"]: c["sqltext"] for c in inspector.get_check_constraints("training_runs")}
        )["ck_training_runs_status"]
    )


def test_constraint_names_follow_the_naming_convention(db_engine: Engine) -> None:
    inspector = inspect(db_engine)
    uniques = {uc["name"] for uc in inspector.get_unique_constraints("step_metrics")}
    assert uniques == {"uq_step_metrics_run_id_step"}
    fks = {fk["name"] for fk in inspector.get_foreign_keys("credit_records")}
    assert fks == {"fk_credit_records_run_id_training_runs"}
    indexes = {ix["name"] for ix in inspector.get_indexes("credit_records")}
    assert {"ix_credit_records_run_id_step", "ix_credit_records_query_id"} <= indexes


# --- repositories ---------------------------------------------------------------------


def test_credit_records_round_trip_across_sessions(db_engine: Engine) -> None:
    factory = make_session_factory(db_engine)
    with session_scope(factory) as session:
        run = repo.create_run(session, name="r", preset="grpo", config={"lr": 1e-6})
        records = [_credit_record(run.id, s, q, i) for s in (2, 1) for q in "ba" for i in (1, 0)]
        records.append(_credit_record(None, None, "api", 0))  # a POST /v1/credits record
        repo.add_credit_records(session, records)
        run_id = run.id

    with factory() as session:
        rows = repo.credit_records_for_run(session, run_id)
        assert [(r.step, r.query_id, r.sample_index) for r in rows] == [
            (s, q, i) for s in (1, 2) for q in "ab" for i in (0, 1)
        ]
        assert len(repo.credit_records_for_run(session, run_id, step=2)) == 4
        expected = _credit_record(run_id, 1, "a", 0)
        for key, value in expected.items():
            assert getattr(rows[0], key) == value, key  # JSON floats round-trip exactly
        assert rows[0].created_at.tzinfo is not None
        assert abs(rows[0].created_at - datetime.now(UTC)) < timedelta(minutes=5)


def test_credit_record_rejects_unknown_field(db_session: Session) -> None:
    with pytest.raises(TypeError, match="shapley"):
        repo.add_credit_records(db_session, [{**_credit_record(None, None, "q", 0), "shapley": []}])


def test_policy_versions(db_session: Session) -> None:
    base = repo.add_policy_version(
        db_session, version="v0", name="smol", base_model="SmolLM2", path="/m/0", kind="base"
    )
    child = repo.add_policy_version(
        db_session,
        version="v1",
        name="smol",
        base_model="SmolLM2",
        path="/m/1",
        kind=PolicyKind.TRAINED,
        step=10,
        parent_id=base.id,
        meta={"loss": "grpo"},
    )
    db_session.commit()
    db_session.expire_all()

    assert repo.get_policy_version_by_version(db_session, "v1") is child
    assert child.parent is base and child.meta == {"loss": "grpo"}
    assert repo.get_policy_version_by_version(db_session, "missing") is None
    assert repo.latest_policy_version(db_session) is child
    assert repo.latest_policy_version(db_session, kind="base") is base
    assert repo.latest_policy_version(db_session, kind="warmstart") is None
    with pytest.raises(ValueError):
        repo.add_policy_version(
            db_session, version="v2", name="x", base_model="x", path="x", kind="bogus"
        )

    with pytest.raises(IntegrityError):
        repo.add_policy_version(
            db_session, version="v0", name="dup", base_model="x", path="x", kind="base"
        )
    db_session.rollback()


def test_run_lifecycle_and_step_metrics(db_session: Session) -> None:
    run = repo.create_run(db_session, name="r", preset="dppo", config={"G": 4})
    assert run.status == RunStatus.RUNNING and run.finished_at is None
    repo.add_step_metrics(db_session, run.id, 1, {"loss": 1, "kl": 0.5}, accepted=True)
    repo.add_step_metrics(db_session, run.id, 0, {"loss": 2.0})
    repo.finish_run(db_session, run.id, notes="done")
    db_session.commit()
    db_session.expire_all()

    assert run.status == "finished" and run.notes == "done"
    assert run.finished_at is not None and run.finished_at >= run.started_at
    steps = repo.step_metrics_for_run(db_session, run.id)
    assert [(m.step, m.metrics, m.accepted) for m in steps] == [
        (0, {"loss": 2.0}, None),
        (1, {"loss": 1.0, "kl": 0.5}, True),
    ]
    with pytest.raises(ValueError, match="not 'running'"):
        repo.finish_run(db_session, run.id, status="running")
    with pytest.raises(LookupError):
        repo.finish_run(db_session, run.id + 999)

    with pytest.raises(IntegrityError):  # unique (run_id, step)
        repo.add_step_metrics(db_session, run.id, 1, {"loss": 0.0})
    db_session.rollback()
    with pytest.raises(IntegrityError):  # foreign key (enforced on SQLite too)
        repo.add_step_metrics(db_session, run.id + 999, 0, {"loss": 0.0})
    db_session.rollback()


def test_audit_report_round_trip(db_session: Session) -> None:
    report = {"by_size": {"1": 0.9, "2": 0.75}, "overall": 0.8}
    row = repo.add_audit_report(
        db_session,
        train_evaluator="surrogate",
        reference_evaluator="replay",
        n_rollouts=64,
        report=report,
        verdict="agree",
    )
    db_session.commit()
    db_session.expire_all()
    assert row.report == report and row.html_path is None and row.verdict == "agree"


def test_naive_datetime_is_rejected(db_session: Session) -> None:
    run = repo.create_run(db_session, name="r", preset="p", config={})
    with pytest.raises(StatementError, match="naive datetime"):
        repo.finish_run(db_session, run.id, finished_at=datetime(2024, 1, 1))
    db_session.rollback()


# --- API keys -------------------------------------------------------------------------


def test_api_keys_are_stored_hashed(db_session: Session) -> None:
    plaintext = repo.create_api_key(db_session, "ci")
    db_session.commit()

    key = repo.verify_api_key(db_session, plaintext)
    assert key is not None and key.name == "ci"
    assert key.key_hash == hashlib.sha256(plaintext.encode()).hexdigest() != plaintext
    assert key.prefix == plaintext[:8]
    stored = [getattr(key, c.key) for c in key.__table__.columns]
    assert not any(isinstance(v, str) and plaintext in v for v in stored)

    assert repo.verify_api_key(db_session, plaintext + "x") is None
    repo.revoke_api_key(db_session, key.id)
    db_session.commit()
    assert repo.verify_api_key(db_session, plaintext) is None


def test_generated_api_keys_are_distinct() -> None:
    plaintext, key_hash, prefix = repo.generate_api_key()
    assert repo.hash_api_key(plaintext) == key_hash and plaintext.startswith(prefix)
    assert len({repo.generate_api_key()[0] for _ in range(100)}) == 100


def test_duplicate_api_key_hash_raises(db_session: Session) -> None:
    plaintext = repo.create_api_key(db_session, "a")
    db_session.add(ApiKey(name="b", key_hash=repo.hash_api_key(plaintext), prefix=plaintext[:8]))
    with pytest.raises(IntegrityError):
        db_session.flush()
    db_session.rollback()


# --- the PostgreSQL gate --------------------------------------------------------------

UNREACHABLE_PG = ["postgresql+psycopg://postgres@127.0.0.1:1/test"]


def test_unreachable_postgres_fails_under_ci(postgres_gate, monkeypatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="required when CI is set"):
        postgres_gate(UNREACHABLE_PG)


def test_unreachable_postgres_skips_outside_ci(postgres_gate, monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="PostgreSQL unavailable"):
        postgres_gate(UNREACHABLE_PG)
