"""Migrations build the schema of the models exactly, up and down, on both backends."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Engine, Integer, MetaData, inspect

from loraplex.platform.db.models import Base
from loraplex.platform.db.session import (
    SchemaError,
    current_revision,
    downgrade,
    ensure_at_head,
    head_revision,
    make_engine,
    upgrade,
)

TABLES = {"tenants", "api_keys", "adapters", "quotas", "usage_records", "rate_counters"}


def _diff(engine: Engine, metadata: MetaData) -> list:
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return compare_metadata(context, metadata)


def test_upgrade_from_empty_then_downgrade_to_base(db_url):
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) is None
        upgrade(db_url)
        assert current_revision(engine) == head_revision()
        assert set(inspect(engine).get_table_names()) >= TABLES
        ensure_at_head(engine)  # no error at head

        downgrade(db_url, "base")
        # alembic keeps its (now empty) version table; nothing of ours is left.
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        assert current_revision(engine) is None

        upgrade(db_url)  # and the way back up works after a full downgrade
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_models_match_migrations(engine):
    assert _diff(engine, Base.metadata) == []


def test_the_diff_would_see_a_drift(engine):
    # Guards the test above against passing vacuously: one extra column must show up.
    drifted = MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(drifted)
    drifted.tables["tenants"].append_column(Column("extra", Integer))
    assert [op[0] for op in _diff(engine, drifted)] == ["add_column"]


def test_ensure_at_head_on_empty_database_says_what_to_run(db_url):
    engine = make_engine(db_url)
    try:
        with pytest.raises(SchemaError, match="loraplex db upgrade"):
            ensure_at_head(engine)
    finally:
        engine.dispose()


def test_ensure_at_head_on_unknown_revision_says_upgrade_loraplex(engine):
    with engine.begin() as connection:
        connection.exec_driver_sql("UPDATE alembic_version SET version_num = 'ffff'")
    with pytest.raises(SchemaError, match="upgrade loraplex"):
        ensure_at_head(engine)
