"""Alembic environment: run by `loraplex.platform.db.session.upgrade()` with a connection.

`loraplex db upgrade` passes its own connection in `config.attributes["connection"]`; without
one (plain `alembic -c ...`), the URL comes from the `sqlalchemy.url` option or the settings.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from loraplex.platform.db.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode copies the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    from loraplex.platform.settings import Settings, normalize_database_url

    url = config.get_main_option("sqlalchemy.url")
    return normalize_database_url(url) if url else Settings().database_url


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    from loraplex.platform.db.session import make_engine

    engine = make_engine(_url())
    try:
        with engine.begin() as connection:
            _configure(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
