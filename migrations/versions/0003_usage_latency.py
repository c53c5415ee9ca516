"""usage records keep the request's queue time and mean time per output token

TTFT (`ttft_ms`) and the end-to-end time (`latency_ms`) were there from the start; with
these two the ledger answers "whose requests wait, and whose decode is slow" per tenant and
adapter.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("queue_ms", "tpot_ms")


def upgrade() -> None:
    # Nullable, no default: old rows have no such timings, and the adds are instant.
    for name in COLUMNS:
        op.add_column("usage_records", sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:  # SQLite rebuilds the table
        for name in COLUMNS:
            batch.drop_column(name)
