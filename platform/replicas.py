"""Each server replica's heartbeat in the registry database: its engine's live state, so that
whichever replica answers the admin overview shows the whole fleet.

Every `replica_heartbeat_s` seconds a replica upserts its row of `replicas` (models.Replica)
with a snapshot of its engine stats, and deletes the row when it shuts down. A replica that
crashed leaves its row behind: after `STALE_BEATS` missed beats the overview marks it stale,
and after `GONE_S` any replica's heartbeat deletes it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loraplex.platform.db.health import note_outage
from loraplex.platform.db.models import Replica, utcnow

log = logging.getLogger(__name__)

# Missed beats before a row counts as stale: one late beat (a busy event loop, a slow
# database) should not flag a healthy replica.
STALE_BEATS = 3
# A row this old belongs to a replica that died without deleting it: nobody will renew it.
GONE_S = 600.0
# Addresses every machine of a fleet may listen on alike: the host name tells them apart.
_NOT_UNIQUE = {"", "0.0.0.0", "::", "127.0.0.1", "::1", "localhost"}


def replica_id(settings: Any) -> str:
    """host:port:pid, unique among the replicas sharing a database: several processes may
    run on one machine (the pid), and pods of one chart all listen on 0.0.0.0:8000 with pid 1
    (the host name, which is the pod's)."""
    host = getattr(settings, "host", "") or ""
    if host in _NOT_UNIQUE:
        host = socket.gethostname()
    port = getattr(settings, "port", None)
    tail = f":{port}:{os.getpid()}" if port else f":{os.getpid()}"
    return host[: 64 - len(tail)] + tail  # the column's width; the tail is what differs


def snapshot(engine: Any) -> dict:
    """The engine's live state as the overview shows it, JSON-able. Adapters keep the names
    the engine gives them (tenant id/name): the reader maps ids to tenant names."""
    body: dict = {"replica": socket.gethostname(), "ready": engine is not None, "alive": False}
    if engine is None:
        return body
    s = engine.stats()
    return body | {
        "alive": s.alive,
        "running": s.running,
        "waiting": s.waiting,
        "paused": s.paused,
        "kv_usage": s.kv_usage,
        "kv_blocks": s.kv_blocks,
        "kv_blocks_used": s.kv_blocks_used,
        "adapter_slots": s.adapter_slots,
        "resident_adapters": list(s.resident_adapters),
        "host_adapters": s.adapters_in_host,
        "adapters_loading": s.adapters_loading,
    }


def beat(session: Session, rid: str, state: dict, *, started_at: datetime,
         now: datetime | None = None, gone_s: float = GONE_S) -> None:  # fmt: skip
    """Write this replica's row, and delete the rows of replicas gone for `gone_s`."""
    now = now or utcnow()
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    insert = dialect.insert(Replica).values(id=rid, started_at=started_at, seen_at=now, state=state)
    # One statement, no read-then-write: two beats of one replica never race to insert.
    session.execute(
        insert.on_conflict_do_update(
            index_elements=[Replica.id],
            set_={"seen_at": insert.excluded.seen_at, "state": insert.excluded.state},
        )
    )
    session.execute(delete(Replica).where(Replica.seen_at < now - timedelta(seconds=gone_s)))
    session.commit()


def remove(session: Session, rid: str) -> None:
    session.execute(delete(Replica).where(Replica.id == rid))
    session.commit()


def fleet(session: Session, *, stale_after_s: float, now: datetime | None = None) -> list[dict]:
    """Every replica's row, oldest first: id, started_at, seen_at, seen_s_ago, stale, state."""
    now = now or utcnow()
    rows = session.scalars(select(Replica).order_by(Replica.started_at, Replica.id)).all()
    out = []
    for r in rows:
        ago = max(0.0, (now - r.seen_at).total_seconds())
        out.append({"id": r.id, "started_at": r.started_at, "seen_at": r.seen_at,
                    "seen_s_ago": ago, "stale": ago > stale_after_s, "state": r.state})  # fmt: skip
    return out


class Heartbeat:
    """One replica's heartbeat over `state` (the app's AppState). `stop` deletes the row for
    good: a beat already running in its thread cannot write it back afterwards."""

    def __init__(self, state: Any, interval_s: float):
        self.state = state
        self.interval_s = interval_s
        self.id = replica_id(state.settings)
        self.started_at = utcnow()
        self._lock = threading.Lock()
        self._stopped = False

    def beat_once(self) -> None:
        with self._lock:
            if self._stopped:
                return
            with self.state.sessions() as session:
                beat(session, self.id, snapshot(self.state.engine), started_at=self.started_at)

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.beat_once)
            except Exception as e:  # a database outage must not stop the server, nor this loop
                if not note_outage(self.state, e):  # an outage is logged once, not each beat
                    log.warning("replica heartbeat failed: %s", e)
            await asyncio.sleep(self.interval_s)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            try:
                with self.state.sessions() as session:
                    remove(session, self.id)
            except Exception as e:  # the row goes stale, then a peer's beat deletes it
                log.warning("removing this replica's heartbeat row failed: %s", e)
