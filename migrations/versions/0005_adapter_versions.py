"""adapter versions and aliases: an upload under a taken name adds a version; aliases point
at one version or split traffic between several; usage records name the version that
answered; quotas get an optional monthly cap on Batch API tokens; replicas write a heartbeat
with their engine's live state

Every existing adapter becomes version 1 of its name, and its name's `default` alias points
at it, so requests naming it are answered as before.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the model type: a migration must not change when models.py does.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:  # SQLite rebuilds the table
        batch.add_column(sa.Column("version", sa.Integer(), server_default="1", nullable=False))
        batch.drop_constraint(op.f("uq_adapters_tenant_id_name"), type_="unique")
        batch.create_unique_constraint(
            op.f("uq_adapters_tenant_id_name_version"), ["tenant_id", "name", "version"]
        )
        batch.create_check_constraint("version_positive", "version > 0")
    op.create_table(
        "adapter_aliases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("weights", sa.JSON(), nullable=False),
        sa.Column("previous", sa.JSON(), nullable=True),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_adapter_aliases_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_aliases")),
        sa.UniqueConstraint(
            "tenant_id", "name", "alias", name=op.f("uq_adapter_aliases_tenant_id_name_alias")
        ),
    )
    # Each existing adapter's name follows it, as requests naming it did before versions.
    op.execute(
        "INSERT INTO adapter_aliases (tenant_id, name, alias, weights, updated_at) "
        "SELECT tenant_id, name, 'default', '{\"1\": 100}', created_at FROM adapters"
    )
    op.add_column("usage_records", sa.Column("adapter_version", sa.Integer(), nullable=True))
    op.add_column("quotas", sa.Column("batch_tokens_per_month", sa.BigInteger(), nullable=True))
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=False),
        sa.Column("seen_at", TIMESTAMP, nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replicas")),
    )
    op.create_index(op.f("ix_replicas_seen_at"), "replicas", ["seen_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_replicas_seen_at"), table_name="replicas")
    op.drop_table("replicas")
    with op.batch_alter_table("quotas") as batch:
        batch.drop_column("batch_tokens_per_month")
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("adapter_version")
    op.drop_table("adapter_aliases")
    # Only each name's newest version survives a downgrade: the old schema has one per name.
    op.execute(
        "DELETE FROM adapters WHERE version < "
        "(SELECT MAX(a.version) FROM adapters a "
        "WHERE a.tenant_id = adapters.tenant_id AND a.name = adapters.name)"
    )
    with op.batch_alter_table("adapters") as batch:
        batch.drop_constraint(op.f("ck_adapters_version_positive"), type_="check")
        batch.drop_constraint(op.f("uq_adapters_tenant_id_name_version"), type_="unique")
        batch.create_unique_constraint(op.f("uq_adapters_tenant_id_name"), ["tenant_id", "name"])
        batch.drop_column("version")
