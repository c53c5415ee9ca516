"""initial registry: tenants, api keys, adapters, quotas, usage records, rate counters

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the model types: a migration must not change when models.py does.
TIMESTAMP = sa.DateTime(timezone=True)
PRICE = sa.Numeric(precision=18, scale=9)
BIGID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _tenant_fk(table: str, ondelete: str | None = "CASCADE") -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["tenant_id"], ["tenants.id"], name=op.f(f"fk_{table}_tenant_id_tenants"), ondelete=ondelete
    )


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("price_prompt_per_1k", PRICE, nullable=False),
        sa.Column("price_completion_per_1k", PRICE, nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint("weight > 0", name=op.f("ck_tenants_weight_positive")),
        sa.CheckConstraint(
            "status IN ('active', 'suspended')", name=op.f("ck_tenants_status_valid")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("last_used_at", TIMESTAMP, nullable=True),
        sa.Column("expires_at", TIMESTAMP, nullable=True),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        _tenant_fk("api_keys"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("base_model", sa.String(length=255), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("targets", sa.JSON(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("storage_key", sa.String(length=512), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("last_used_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint("rank > 0", name=op.f("ck_adapters_rank_positive")),
        sa.CheckConstraint(
            "status IN ('uploading', 'ready', 'failed', 'deleted')",
            name=op.f("ck_adapters_status_valid"),
        ),
        _tenant_fk("adapters"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint("tenant_id", "name", name=op.f("uq_adapters_tenant_id_name")),
    )
    op.create_index(op.f("ix_adapters_sha256"), "adapters", ["sha256"])
    op.create_table(
        "quotas",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("requests_per_min", sa.Integer(), nullable=True),
        sa.Column("tokens_per_min", sa.BigInteger(), nullable=True),
        sa.Column("tokens_per_month", sa.BigInteger(), nullable=True),
        sa.Column("max_adapters", sa.Integer(), nullable=True),
        sa.Column("max_adapter_bytes", sa.BigInteger(), nullable=True),
        sa.Column("max_rank", sa.Integer(), nullable=True),
        _tenant_fk("quotas"),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_quotas")),
    )
    op.create_table(
        "usage_records",
        sa.Column("id", BIGID, nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("adapter_name", sa.String(length=128), nullable=True),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint(
            "status IN ('ok', 'aborted', 'error', 'rejected')",
            name=op.f("ck_usage_records_status_valid"),
        ),
        sa.ForeignKeyConstraint(
            ["api_key_id"],
            ["api_keys.id"],
            name=op.f("fk_usage_records_api_key_id_api_keys"),
            ondelete="SET NULL",
        ),
        _tenant_fk("usage_records", ondelete=None),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_records")),
        sa.UniqueConstraint("request_id", name=op.f("uq_usage_records_request_id")),
    )
    op.create_index(op.f("ix_usage_records_created_at"), "usage_records", ["created_at"])
    op.create_index(
        "ix_usage_records_tenant_id_created_at", "usage_records", ["tenant_id", "created_at"]
    )
    op.create_table(
        "rate_counters",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("window_start", TIMESTAMP, nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        _tenant_fk("rate_counters"),
        sa.PrimaryKeyConstraint("tenant_id", "window_start", name=op.f("pk_rate_counters")),
    )


def downgrade() -> None:
    # Dropping a table drops its indexes and constraints; children before parents.
    for table in ("rate_counters", "usage_records", "quotas", "adapters", "api_keys", "tenants"):
        op.drop_table(table)
