"""Engines, sessions and schema migrations (alembic, run in-process: no alembic.ini needed)."""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from loraplex.platform.settings import normalize_database_url

UPGRADE_HINT = "run `loraplex db upgrade`"
CONNECT_TIMEOUT_S = 5  # PostgreSQL: how long a connection attempt may wait for the server


class SchemaError(RuntimeError):
    """The database schema is not the one this version of loraplex was written for."""


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine with the settings each backend needs to be shared by threads and replicas."""
    url = normalize_database_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        # A database that does not answer must fail a connection attempt, not hang it: the
        # request then gets 503 database_unavailable and its usage goes to the journal.
        connect_args = {"connect_timeout": CONNECT_TIMEOUT_S, **kwargs.pop("connect_args", {})}
        # Replicas sit behind pools that outlive database restarts and idle-connection reaping.
        return create_engine(url, pool_pre_ping=True, connect_args=connect_args, **kwargs)

    database = parsed.database or ""
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    # The server uses sessions from worker threads; 30 s of waiting out another writer beats
    # failing a request with "database is locked".
    connect_args = {"check_same_thread": False, "timeout": 30, **kwargs.pop("connect_args", {})}
    engine = create_engine(url, connect_args=connect_args, **kwargs)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")  # off by default in SQLite
        if database and database != ":memory:":
            cursor.execute("PRAGMA journal_mode=WAL")  # readers don't block the writer
        cursor.close()

    return engine


def make_probe_engine(url: str) -> Engine:
    """An engine for health probes: a fresh connection each time (NullPool), so a probe
    neither waits behind requests for a pooled connection nor trusts one a restart broke."""
    return make_engine(url, poolclass=NullPool)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    # Rows returned by CRUD functions stay readable after their commit (no lazy reload).
    return sessionmaker(engine, expire_on_commit=False)


def _migrations_dir() -> Path:
    # Installed or editable, migrations/ sits two levels above platform/db/ (the wheel maps
    # it to loraplex/migrations next to loraplex/platform), so look there first.
    beside = Path(__file__).resolve().parents[2] / "migrations"
    if (beside / "env.py").is_file():
        return beside
    try:
        packaged = Path(str(importlib.resources.files("loraplex.migrations")))
    except (ModuleNotFoundError, NotADirectoryError) as e:
        raise SchemaError(f"loraplex's migrations are missing ({e}): reinstall loraplex") from e
    return packaged


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_migrations_dir()))
    if connection is not None:
        # Passing the connection (not the URL) avoids ConfigParser's '%' interpolation of
        # passwords and reuses our engine settings.
        cfg.attributes["connection"] = connection
    return cfg


@contextmanager
def _connect(url_or_engine: str | Engine) -> Iterator[Connection]:
    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    try:
        with engine.begin() as connection:
            yield connection
    finally:
        if isinstance(url_or_engine, str):
            engine.dispose()


def upgrade(url: str | Engine, revision: str = "head") -> None:
    """Migrate the database to `revision` (what `loraplex db upgrade` runs)."""
    with _connect(url) as connection:
        command.upgrade(alembic_config(connection), revision)


def downgrade(url: str | Engine, revision: str = "base") -> None:
    """Migrate down to `revision`; "base" drops every loraplex table."""
    with _connect(url) as connection:
        command.downgrade(alembic_config(connection), revision)


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/versions holds no revision"
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; None for a database never migrated."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def ensure_at_head(engine: Engine) -> None:
    """Refuse to run on a schema older (or newer) than the code's migrations."""
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    url = engine.url.render_as_string(hide_password=True)
    if current is None:
        raise SchemaError(f"database {url} has no loraplex schema: {UPGRADE_HINT}")
    known = {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current not in known:
        raise SchemaError(
            f"database {url} is at revision {current}, which this version of loraplex does not "
            "know (written by a newer version?): upgrade loraplex"
        )
    raise SchemaError(f"database {url} is at revision {current}, not {head}: {UPGRADE_HINT}")
