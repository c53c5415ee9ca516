"""Database fixtures: every registry test runs on SQLite and on PostgreSQL.

PostgreSQL is the server at `LORAPLEX_TEST_POSTGRES` (default: the local one, trust auth).
One throwaway database is created for the test session and dropped at its end; each test
starts from an empty `public` schema in it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, make_url
from sqlalchemy.orm import Session

from loraplex.platform.db import crud
from loraplex.platform.db.models import Tenant
from loraplex.platform.db.session import make_engine, make_sessionmaker, upgrade

PG_SERVER = os.environ.get("LORAPLEX_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_admin_connect() -> psycopg.Connection:
    url = make_url(PG_SERVER)
    users = [url.username] if url.username else ["postgres", "root"]
    error: Exception | None = None
    for user in users:  # a local cluster's superuser is "postgres" or the OS user
        try:
            return psycopg.connect(
                host=url.host or "127.0.0.1",
                port=url.port or 5432,
                user=user,
                password=url.password,
                dbname=url.database or "postgres",
                autocommit=True,
                connect_timeout=3,
            )
        except psycopg.OperationalError as e:
            error = e
    # PostgreSQL runs on every machine of this kind (CI included): its absence is a failure.
    pytest.fail(
        f"PostgreSQL unreachable at {PG_SERVER} ({error}); start it or set LORAPLEX_TEST_POSTGRES"
    )


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    admin = _pg_admin_connect()
    name = f"loraplex_test_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')
    user = admin.info.user
    try:
        url = make_url(PG_SERVER).set(username=user, database=name, drivername="postgresql")
        yield url.render_as_string(hide_password=False)
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def _empty_pg_schema(url: str) -> None:
    # Faster than a fresh database per test; lock_timeout turns a leaked connection into an
    # error instead of a hang.
    parsed = make_url(url)
    with psycopg.connect(
        host=parsed.host, port=parsed.port, user=parsed.username, password=parsed.password,
        dbname=parsed.database,
        autocommit=True,
    ) as conn:  # fmt: skip
        conn.execute("SET lock_timeout = '10s'")
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """The URL of an empty database (no tables)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    url = request.getfixturevalue("pg_database_url")
    _empty_pg_schema(url)
    return url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """An engine on a database migrated to head."""
    upgrade(db_url)
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    with make_sessionmaker(engine)() as session:
        yield session


@pytest.fixture
def tenant(session: Session) -> Tenant:
    return crud.create_tenant(
        session, name="acme", price_prompt_per_1k="0.0015", price_completion_per_1k="0.002"
    )


@pytest.fixture(scope="package")
def replicas(tiny_models, pg_database_url, tmp_path_factory):
    """Two `loraplex serve` processes on one PostgreSQL and one moto S3 (tests/utils/replicas.py),
    shared by the fleet tests of this folder: each test makes its own tenants."""
    from tests.utils.replicas import start_replicas

    _empty_pg_schema(pg_database_url)
    root = tmp_path_factory.mktemp("fleet")
    with start_replicas(tiny_models["llama"], pg_database_url, root) as fleet:
        yield fleet
