"""credit game: the merge rule of a credit record's coalition lists, and its pool counts

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04 15:00:00+00:00

- `credit_records.merge`: how the coalition lists were built: 'max' | 'rrf' (the list game) |
  'pool' (the pooled-candidates game); NULL on records stored before it was recorded;
- `credit_records.pool`: in the pooled game, who found what, as counts (the query's own list,
  the whole pool, per rewrite the documents it found that the query's list lacks and those only
  it found); NULL in the list game.
Both nullable, added in place: a writer that predates them keeps inserting.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON(none_as_null=True).with_variant(
        postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), "postgresql"
    )


def upgrade() -> None:
    op.add_column("credit_records", sa.Column("merge", sa.String(length=16), nullable=True))
    op.add_column("credit_records", sa.Column("pool", _json(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("credit_records") as batch:
        batch.drop_column("pool")
        batch.drop_column("merge")
