"""api: API-key scopes and training jobs started by the REST API

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 22:00:00+00:00

- `api_keys.scope`: 'user' (rewrites, credits, reads) or 'admin' (also jobs and activation);
- `train_jobs`: a `casi train` process started by `POST /v1/train-jobs` (status, pid, log).
Batch mode so SQLite (no ALTER of constraints) gets the same schema as PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON(none_as_null=True).with_variant(
        postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), "postgresql"
    )


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(
            sa.Column("scope", sa.String(length=16), server_default="user", nullable=False)
        )
        batch.create_check_constraint(op.f("ck_api_keys_scope"), "scope IN ('user', 'admin')")
    op.create_table(
        "train_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("preset", sa.String(length=200), nullable=False),
        sa.Column("overrides", _json(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("log_path", sa.String(length=1024), nullable=True),
        sa.Column("run_name", sa.String(length=200), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'finished', 'failed', 'cancelled')",
            name=op.f("ck_train_jobs_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_train_jobs")),
    )
    op.create_index(op.f("ix_train_jobs_status"), "train_jobs", ["status"])


def downgrade() -> None:
    op.drop_index(op.f("ix_train_jobs_status"), table_name="train_jobs")
    op.drop_table("train_jobs")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_constraint(op.f("ck_api_keys_scope"), type_="check")
        batch.drop_column("scope")
