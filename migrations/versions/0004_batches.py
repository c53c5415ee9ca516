"""the Batch API: files, batches and their finished lines; usage records get a request class,
tenants a batch price factor

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the model type: a migration must not change when models.py does.
TIMESTAMP = sa.DateTime(timezone=True)
BATCH_STATES = (
    "'validating', 'failed', 'in_progress', 'finalizing', 'completed', 'expired', "
    "'cancelling', 'cancelled'"
)


def upgrade() -> None:
    # Server defaults: existing rows are interactive requests and tenants at half price.
    op.add_column(
        "usage_records",
        sa.Column(
            "request_class", sa.String(length=16), nullable=False, server_default="interactive"
        ),
    )
    with op.batch_alter_table("usage_records") as batch:
        batch.create_check_constraint(
            "request_class_valid", "request_class IN ('interactive', 'batch')"
        )
    op.add_column(
        "tenants",
        sa.Column("batch_price_factor", sa.Numeric(6, 4), nullable=False, server_default="0.5"),
    )
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("lines", sa.Integer(), nullable=False),
        sa.Column("storage_key", sa.String(length=512), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_files_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
    )
    op.create_index("ix_files_tenant_id", "files", ["tenant_id"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("input_file_id", sa.String(length=40), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=8), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("output_file_id", sa.String(length=40), nullable=True),
        sa.Column("error_file_id", sa.String(length=40), nullable=True),
        sa.Column("runner", sa.String(length=64), nullable=True),
        sa.Column("lease_until", TIMESTAMP, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        *[
            sa.Column(f"{state}_at", TIMESTAMP, nullable=True)
            for state in (
                "in_progress",
                "finalizing",
                "completed",
                "failed",
                "expired",
                "cancelling",
                "cancelled",
            )  # fmt: skip
        ],
        sa.CheckConstraint(f"status IN ({BATCH_STATES})", name=op.f("ck_batches_status_valid")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_batches_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["api_key_id"],
            ["api_keys.id"],
            name="fk_batches_api_key_id_api_keys",
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
    )
    op.create_index("ix_batches_tenant_id", "batches", ["tenant_id"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(length=40), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("result", sa.Text(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["batches.id"],
            name="fk_batch_lines_batch_id_batches",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("batch_id", "line", name="pk_batch_lines"),
    )


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_tenant_id", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_files_tenant_id", table_name="files")
    op.drop_table("files")
    with op.batch_alter_table("tenants") as batch:  # SQLite rebuilds the table
        batch.drop_column("batch_price_factor")
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_constraint("request_class_valid", type_="check")
        batch.drop_column("request_class")
