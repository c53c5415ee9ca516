"""Is the database reachable? One answer for the whole server, kept by a probe and by every
request that found it away.

A database outage is an operational state, not a bug of ours: requests that need the
database answer 503 `database_unavailable` (platform/api/errors.py), `/readyz` says false,
usage records wait in the local journal (platform/ledger.py), and the log gets one line when
the outage starts and one when it ends, instead of a traceback per request.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import Engine, select
from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout

log = logging.getLogger("loraplex.platform")


def is_unavailable(e: BaseException) -> bool:
    """Whether `e` says the database could not be reached or answer (connection refused or
    lost, the pool's wait ran out), rather than that our statement was wrong."""
    if isinstance(e, OperationalError | InterfaceError | DisconnectionError | PoolTimeout):
        return True
    return isinstance(e, DBAPIError) and e.connection_invalidated


def one_line(e: BaseException) -> str:
    # The driver's message without SQLAlchemy's appended statement and background link.
    cause = getattr(e, "orig", None) or e
    return " ".join(str(cause).split())[:300]


class DatabaseHealth:
    """The database's state as this server last saw it; safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.down_since: float | None = None  # time.monotonic() of the first failure seen
        self.cause: str | None = None

    @property
    def up(self) -> bool:
        return self.down_since is None

    def failed(self, e: BaseException) -> None:
        """Note a failure to reach the database; logs only the first of an outage."""
        with self._lock:
            if self.down_since is not None:
                return
            self.down_since, self.cause = time.monotonic(), one_line(e)
        log.warning("the database is unreachable: %s", self.cause)

    def reached(self) -> None:
        """Note a successful round trip; ends an outage (and logs how long it lasted)."""
        with self._lock:
            if self.down_since is None:
                return
            lasted = time.monotonic() - self.down_since
            self.down_since, self.cause = None, None
        log.warning("the database is reachable again (unreachable for %.1f s)", lasted)

    def probe(self, engine: Engine) -> bool:
        """One `SELECT 1` on `engine` (give it a connect timeout); records the result."""
        try:
            with engine.connect() as connection:
                connection.execute(select(1))
        except Exception as e:  # noqa: BLE001 - whatever stops the round trip is an outage here
            self.failed(e)
            return False
        self.reached()
        return True


def note_outage(state, e: BaseException) -> bool:
    """For background loops (heartbeat, batch polling): if `e` is the database being away,
    tell `state.database` (one log line per outage) and say True, so that the loop logs
    nothing of its own each turn; else False."""
    health = getattr(state, "database", None)
    if health is None or not is_unavailable(e):
        return False
    health.failed(e)
    return True
