"""training: held-out evaluations, the credit game's anchor mode, checkpoints' run, cancelled runs

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 21:40:00+00:00

- `evaluations`: held-out retrieval of a policy version (query alone / rewrites / query + rewrites);
- `credit_records.anchor_query`: whether the query's own list was in every coalition;
- `policy_versions.run_id`: the training run that wrote a checkpoint;
- `training_runs.status` may be 'cancelled'.
Batch mode so SQLite (no ALTER of constraints) gets the same schema as PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON(none_as_null=True).with_variant(
        postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), "postgresql"
    )


def upgrade() -> None:
    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("policy_version_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("split", sa.String(length=32), nullable=False),
        sa.Column("n_queries", sa.Integer(), nullable=False),
        sa.Column("metrics", _json(), nullable=False),
        sa.Column("config", _json(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["policy_version_id"], ["policy_versions.id"],
            name=op.f("fk_evaluations_policy_version_id_policy_versions"), ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["training_runs.id"],
            name=op.f("fk_evaluations_run_id_training_runs"), ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluations")),
    )
    op.create_index(op.f("ix_evaluations_policy_version_id"), "evaluations", ["policy_version_id"])
    op.create_index(op.f("ix_evaluations_run_id_step"), "evaluations", ["run_id", "step"])
    with op.batch_alter_table("credit_records") as batch:
        batch.add_column(
            sa.Column("anchor_query", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    with op.batch_alter_table("policy_versions") as batch:
        batch.add_column(sa.Column("run_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            op.f("fk_policy_versions_run_id_training_runs"), "training_runs", ["run_id"], ["id"],
            ondelete="SET NULL",
        )
    with op.batch_alter_table("training_runs") as batch:
        batch.drop_constraint(op.f("ck_training_runs_status"), type_="check")
        batch.create_check_constraint(
            op.f("ck_training_runs_status"), "status IN ('running', 'finished', 'failed', 'cancelled')"
        )


def downgrade() -> None:
    # 0001 knows no cancelled run: one would fail the CHECK (and, on SQLite, strand batch mode's
    # temporary table so that a retry fails too)
    op.execute("UPDATE training_runs SET status = 'failed' WHERE status = 'cancelled'")
    with op.batch_alter_table("training_runs") as batch:
        batch.drop_constraint(op.f("ck_training_runs_status"), type_="check")
        batch.create_check_constraint(
            op.f("ck_training_runs_status"), "status IN ('running', 'finished', 'failed')"
        )
    with op.batch_alter_table("policy_versions") as batch:
        batch.drop_constraint(op.f("fk_policy_versions_run_id_training_runs"), type_="foreignkey")
        batch.drop_column("run_id")
    with op.batch_alter_table("credit_records") as batch:
        batch.drop_column("anchor_query")
    op.drop_index(op.f("ix_evaluations_run_id_step"), table_name="evaluations")
    op.drop_index(op.f("ix_evaluations_policy_version_id"), table_name="evaluations")
    op.drop_table("evaluations")
