"""The load-and-fault suite's size, database and results.

`LORAPLEX_SOAK=full` runs it at a tenant's scale (200 streams); the default is the small size
CI runs. The database is a throwaway one on the local PostgreSQL (127.0.0.1:5432, trust auth)
when that answers, else SQLite. Every scenario's figures go to `soak.json` under
`LORAPLEX_ARTIFACTS` (default /tmp/artifacts) and are printed at the end of the run.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import make_url

PG_SERVER = os.environ.get("LORAPLEX_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
FULL = os.environ.get("LORAPLEX_SOAK", "small") == "full"
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="session")
def soak_size() -> dict[str, int]:
    if FULL:
        return {
            "streams": 200,
            "tenants": 3,
            "adapters": 16,
            "max_tokens": 24,
            "burst": 4,
            "fault_streams": 40,
            "races": 60,
        }
    return {
        "streams": 48,
        "tenants": 3,
        "adapters": 16,
        "max_tokens": 16,
        "burst": 4,
        "fault_streams": 12,
        "races": 20,
    }


@pytest.fixture(scope="session")
def soak_database() -> Iterator[str | None]:
    """A PostgreSQL URL for a fresh database, or None (each server then uses its SQLite)."""
    url = make_url(PG_SERVER)
    try:
        admin = psycopg.connect(
            host=url.host or "127.0.0.1",
            port=url.port or 5432,
            user=url.username or "postgres",
            dbname=url.database or "postgres",
            autocommit=True,
            connect_timeout=3,
        )
    except psycopg.OperationalError:
        yield None
        return
    name = f"loraplex_soak_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url.set(database=name, drivername="postgresql").render_as_string(hide_password=False)
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture(scope="session")
def record():
    def put(scenario: str, **figures) -> None:
        RESULTS[scenario] = figures

    return put


def pytest_sessionfinish(session, exitstatus):
    if not RESULTS:
        return
    out = Path(os.environ.get("LORAPLEX_ARTIFACTS", "/tmp/artifacts")) / "soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"size": "full" if FULL else "small", "results": RESULTS}, indent=2, default=str)
    )
    print(f"\nload-and-fault figures ({'full' if FULL else 'small'} size) -> {out}")
    for scenario, figures in RESULTS.items():
        print(f"  {scenario}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
