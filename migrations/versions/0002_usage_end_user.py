"""usage records keep the request's `user` field (end_user)

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: existing rows had no such field, and the add is instant.
    op.add_column("usage_records", sa.Column("end_user", sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:  # SQLite rebuilds the table
        batch.drop_column("end_user")
