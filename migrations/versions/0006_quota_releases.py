"""quota releases: a reservation given back for a request that never ran is written once,
keyed by its request id, however often the server's usage journal replays it

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the model type: a migration must not change when models.py does.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "quota_releases",
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_quota_releases")),
    )
    op.create_index(op.f("ix_quota_releases_created_at"), "quota_releases", ["created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_quota_releases_created_at"), table_name="quota_releases")
    op.drop_table("quota_releases")
