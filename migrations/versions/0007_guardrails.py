"""guardrails: per-tenant (and per-key) input/output policies and their audit events

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the model types: a migration must not change when models.py does.
TIMESTAMP = sa.DateTime(timezone=True)
BIGID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "guardrail_policies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("stages", sa.String(length=8), nullable=False),
        sa.Column("action", sa.String(length=8), nullable=False),
        sa.Column("terms", sa.JSON(), nullable=False),
        sa.Column("patterns", sa.JSON(), nullable=False),
        sa.Column("pii", sa.JSON(), nullable=False),
        sa.Column("guard_adapter", sa.String(length=160), nullable=True),
        sa.Column("guard_tenant_id", sa.Integer(), nullable=True),
        sa.Column("guard_threshold", sa.Float(), nullable=False),
        sa.Column("fail_mode", sa.String(length=8), nullable=False),
        sa.Column("record_text", sa.Boolean(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint(
            "stages IN ('input', 'output', 'both')",
            name=op.f("ck_guardrail_policies_stages_valid"),
        ),
        sa.CheckConstraint(
            "action IN ('block', 'redact', 'flag')",
            name=op.f("ck_guardrail_policies_action_valid"),
        ),
        sa.CheckConstraint(
            "fail_mode IN ('open', 'closed')", name=op.f("ck_guardrail_policies_fail_mode_valid")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_guardrail_policies_tenant_id_tenants"),
            ondelete="CASCADE",
        ),  # fmt: skip
        sa.ForeignKeyConstraint(
            ["api_key_id"],
            ["api_keys.id"],
            name=op.f("fk_guardrail_policies_api_key_id_api_keys"),
            ondelete="CASCADE",
        ),  # fmt: skip
        sa.ForeignKeyConstraint(
            ["guard_tenant_id"],
            ["tenants.id"],
            name=op.f("fk_guardrail_policies_guard_tenant_id_tenants"),
            ondelete="SET NULL",
        ),  # fmt: skip
        sa.PrimaryKeyConstraint("id", name=op.f("pk_guardrail_policies")),
    )
    op.create_index(op.f("ix_guardrail_policies_tenant_id"), "guardrail_policies", ["tenant_id"])
    op.create_table(
        "guardrail_events",
        sa.Column("id", BIGID, nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("policy_id", sa.Integer(), nullable=True),
        sa.Column("policy_name", sa.String(length=64), nullable=False),
        sa.Column("rule", sa.String(length=200), nullable=False),
        sa.Column("stage", sa.String(length=8), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("request_id", sa.String(length=80), nullable=False),
        sa.Column("route", sa.String(length=16), nullable=False),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_guardrail_events_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["api_key_id"],
            ["api_keys.id"],
            name=op.f("fk_guardrail_events_api_key_id_api_keys"),
            ondelete="SET NULL",
        ),  # fmt: skip
        sa.ForeignKeyConstraint(
            ["policy_id"],
            ["guardrail_policies.id"],
            name=op.f("fk_guardrail_events_policy_id_guardrail_policies"),
            ondelete="SET NULL",
        ),  # fmt: skip
        sa.PrimaryKeyConstraint("id", name=op.f("pk_guardrail_events")),
    )
    op.create_index(
        "ix_guardrail_events_tenant_id_created_at",
        "guardrail_events",
        ["tenant_id", "created_at"],
    )


def downgrade() -> None:
    op.drop_index("ix_guardrail_events_tenant_id_created_at", table_name="guardrail_events")
    op.drop_table("guardrail_events")
    op.drop_index(op.f("ix_guardrail_policies_tenant_id"), table_name="guardrail_policies")
    op.drop_table("guardrail_policies")
