"""tenants keep a prefix-cache salt (issue 56): rotating it makes the tenant's cached KV,
device pool and KV tiers alike, unreachable; null (every tenant until its first rotation)
keys the cache by tenant id alone, as before

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: existing tenants keep the keys they have, and the add is instant.
    op.add_column("tenants", sa.Column("cache_salt", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:  # SQLite rebuilds the table
        batch.drop_column("cache_salt")
