"""Writing the usage ledger so that no outage loses a bill.

A request's usage record and its quota correction are one database transaction, written
when the request ends. If the database cannot take it then (an outage, a restart), the entry
goes to the local journal (platform/journal.py, in the data dir, fsynced) and is written once
the database answers again, by `watch_database`, also after this server was killed and
started again. Exactly once: the record's request id is unique in `usage_records`, and the
quota correction is applied only in the transaction that inserted the record, so replaying an
entry the database already holds (a crash between the commit and the journal's delete)
changes nothing. A release (the reservation of a request that never ran, given back) is keyed
the same way by a `quota_releases` row written in its transaction.

While the journal holds entries, new ones go behind them rather than straight to the
database, so the first record of a request id is the one billed whatever the outage did to
the order (batch lines reuse their id on a retry).

Writes group-commit: a `write` that finds another in progress waits for it, and the next
one takes every entry that waited meanwhile into one transaction (one multi-row INSERT of
the records, the quota corrections summed per tenant and minute), so under many requests
the database sees a transaction per round trip rather than per request, with no timer to
wait for: a lone request is written at once. Each entry keeps its own outcome: the batch
goes to the journal whole in an outage, and one entry the database refuses sends the batch
back to one transaction per entry, so it alone is refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform import quotas, usage
from loraplex.platform.db.health import DatabaseHealth, is_unavailable, one_line
from loraplex.platform.db.models import QuotaRelease, UsageRecord
from loraplex.platform.journal import Entry, Journal

log = logging.getLogger("loraplex.platform")
REPLAY_BATCH = 100
WRITE_BATCH = 200  # entries per grouped transaction (16 columns each: SQLite's bind limit)
WAIT_CHECK_S = 0.05  # how often an entry waiting for its turn looks whether the database went
RELEASES_KEPT = timedelta(days=7)


def usage_entry(
    record: dict[str, Any], *, tenant_id: int, adjust: int, charged_at: datetime
) -> Entry:
    """A request's usage record (`usage.record_usage`'s arguments, `created_at` set) and the
    correction of its quota charge (`adjust` tokens to the minute it was charged in)."""
    payload = {
        "record": {**record, "created_at": record["created_at"].isoformat()},
        "tenant_id": tenant_id,
        "adjust": adjust,
        "charged_at": charged_at.isoformat(),
    }
    return Entry(record["request_id"], "usage", payload)


def release_entry(request_id: str, *, tenant_id: int, adjust: int, charged_at: datetime) -> Entry:
    payload = {"tenant_id": tenant_id, "adjust": adjust, "charged_at": charged_at.isoformat()}
    return Entry(f"release:{request_id}", "release", payload)


def apply(session: Session, entry: Entry) -> None:
    """Write one entry in one transaction (commits)."""
    p = entry.payload
    charged = datetime.fromisoformat(p["charged_at"])
    if entry.kind == "usage":
        record = {**p["record"], "created_at": datetime.fromisoformat(p["record"]["created_at"])}
        first = usage.record_usage(session, commit=False, **record)
    else:
        first = _first_release(session, entry.key.removeprefix("release:"), charged)
    if first:  # else the database has it already, and its quota correction with it
        quotas.adjust_tokens(session, p["tenant_id"], p["adjust"], now=charged, commit=False)
    session.commit()


def _first_release(session: Session, request_id: str, charged: datetime) -> bool:
    insert = (postgresql if session.get_bind().dialect.name == "postgresql" else sqlite).insert
    done = session.execute(
        insert(QuotaRelease)
        .values(request_id=request_id)
        .on_conflict_do_nothing(index_elements=[QuotaRelease.request_id])
        .returning(QuotaRelease.request_id)
    ).scalar_one_or_none()
    # A replay comes within an outage's length of its release: older rows have done their part.
    session.execute(delete(QuotaRelease).where(QuotaRelease.created_at < charged - RELEASES_KEPT))
    return done is not None


def apply_many(session: Session, entries: list[Entry]) -> None:
    """Write entries of distinct keys in one transaction (commits): `apply` for each, with
    the usage records in one statement and their quota corrections summed."""
    usages = [e for e in entries if e.kind == "usage"]
    records = [
        {**e.payload["record"],
         "created_at": datetime.fromisoformat(e.payload["record"]["created_at"])}
        for e in usages
    ]  # fmt: skip
    first = _first_records(session, records)
    adjusts: dict[tuple[int, datetime], list[int]] = defaultdict(list)
    for e in entries:
        charged = datetime.fromisoformat(e.payload["charged_at"])
        if e.kind == "usage":
            if e.key not in first:
                continue  # the database has it already, and its quota correction with it
        elif not _first_release(session, e.key.removeprefix("release:"), charged):
            continue
        minute = quotas.minute_start(charged)
        adjusts[e.payload["tenant_id"], minute].append(e.payload["adjust"])
    for (tenant_id, minute), deltas in adjusts.items():
        # A counter never goes below zero: summed corrections clamp as one-by-one ones do
        # only when none of them adds (then each step can only lower it, as the sum does).
        for delta in [sum(deltas)] if max(deltas) <= 0 else deltas:
            quotas.adjust_tokens(session, tenant_id, delta, now=minute, commit=False)
    session.commit()


def _first_records(session: Session, records: list[dict[str, Any]]) -> set[str]:
    """The request ids of `records` (distinct) that had no record yet, now written."""
    if not records:
        return set()
    rows = [usage.record_values(**r) for r in records]
    insert = (postgresql if session.get_bind().dialect.name == "postgresql" else sqlite).insert
    inserted = session.execute(
        insert(UsageRecord)
        .values(rows)
        .on_conflict_do_nothing(index_elements=[UsageRecord.request_id])
        .returning(UsageRecord.request_id)
    ).scalars()
    return set(inserted)


@dataclass(eq=False)
class _Waiting:
    entry: Entry
    done: bool | None = None  # write's answer, once the batch that took it is written


class Ledger:
    """Writes entries to the database, or to the journal while it cannot take them."""

    def __init__(self, sessions: sessionmaker, journal: Journal, health: DatabaseHealth):
        self.sessions, self.journal, self.health = sessions, journal, health
        self._replaying = threading.Lock()
        self._turn = threading.Condition()  # group commit (module doc)
        self._waiting: list[_Waiting] = []
        self._writing = False

    def write(self, entry: Entry) -> bool:
        """Write `entry` now, or keep it in the journal; True if the database has it. Never
        raises: called where a request ends, whose answer must end cleanly whatever this does.
        Safe from any number of threads at once, whose entries it writes together."""
        me = _Waiting(entry)
        with self._turn:
            self._waiting.append(me)
        while True:  # more than WRITE_BATCH waiting: the batch taken may not hold `me`
            with self._turn:
                if not self._wait_turn(me):  # the database went away meanwhile
                    self._waiting.remove(me)
                    break
                if me.done is not None:  # a batch took it
                    return me.done
                self._writing = True
                batch, self._waiting = self._waiting[:WRITE_BATCH], self._waiting[WRITE_BATCH:]
            done: list[bool] = []
            try:
                done = self._write_batch([w.entry for w in batch])
            finally:
                with self._turn:
                    for i, w in enumerate(batch):
                        w.done = done[i] if i < len(done) else False
                    self._writing = False
                    self._turn.notify_all()
        self._keep(entry)
        return False

    def _wait_turn(self, me: _Waiting) -> bool:
        """Wait (holding `_turn`) until no write runs or a batch took `me`; False, at once,
        if the database is known to be away while `me` waits untaken. The write in progress
        may be stuck on it until its timeout: an entry that came alone would go to the
        journal at once (`_write_batch`), and so does this one."""
        while self._writing and me.done is None:
            # (`me` in the batch being written waits for that batch's answer.)
            if (len(self.journal) or not self.health.up) and me in self._waiting:
                return False
            self._turn.wait(WAIT_CHECK_S)
        return True

    def _write_batch(self, entries: list[Entry]) -> list[bool]:
        # Behind the entries that wait (see the module doc); and while the database is known
        # to be away, without a connection attempt that could only wait for its timeout.
        if len(self.journal) or not self.health.up:
            for entry in entries:
                self._keep(entry)
            return [False] * len(entries)
        # A key twice in one batch (a batch line retried): one by one, in order, so the first
        # is written and the second finds it there.
        if len(entries) == 1 or len({e.key for e in entries}) < len(entries):
            return [self._write_one(e) for e in entries]
        try:
            with self.sessions() as session:
                apply_many(session, entries)
        except Exception as e:  # noqa: BLE001 - sorted below
            if not is_unavailable(e):  # one entry refused: each on its own finds which
                return [self._write_one(entry) for entry in entries]
            self.health.failed(e)
            for entry in entries:
                self._keep(entry)
            return [False] * len(entries)
        return [True] * len(entries)

    def _write_one(self, entry: Entry) -> bool:
        if len(self.journal) or not self.health.up:
            self._keep(entry)
            return False
        try:
            with self.sessions() as session:
                apply(session, entry)
        except Exception as e:  # noqa: BLE001 - an outage or not, the request's answer goes on
            if not is_unavailable(e):
                return self._refused(entry, e)
            self.health.failed(e)
            self._keep(entry)
            return False
        return True

    def _keep(self, entry: Entry) -> None:
        try:
            self.journal.add(entry)
        except Exception:  # the data dir is full or gone: the log is the last record left
            log.exception("usage entry lost (journal not writable): %s", entry)

    def _refused(self, entry: Entry, e: Exception) -> bool:
        # The database refused this entry itself (a bug, or a row it names gone): retrying it
        # would refuse it again, and hold every entry behind it in the journal.
        log.error("usage entry refused by the database: %s: %s", one_line(e), entry)
        return False

    def replay(self) -> int:
        """Write the journal's entries to the database, oldest first, until it fails or none
        is left; how many were written. One replay at a time (another call returns 0)."""
        if not self._replaying.acquire(blocking=False):
            return 0
        try:
            written = 0
            while batch := self.journal.oldest(REPLAY_BATCH):
                for entry in batch:
                    try:
                        with self.sessions() as session:
                            apply(session, entry)
                    except Exception as e:  # noqa: BLE001 - sorted below
                        if is_unavailable(e):
                            self.health.failed(e)
                            return written
                        self._refused(entry, e)
                    else:
                        self.health.reached()
                    self.journal.remove(entry.key)
                    written += 1
            return written
        finally:
            self._replaying.release()

    def close(self) -> None:
        self.journal.close()


async def watch_database(state, interval_s: float = 1.0) -> None:
    """Probe the database every `interval_s` (what /readyz reports) and, while it answers,
    write what the journal holds. Runs for the app's lifetime."""
    from loraplex.platform.db.session import make_probe_engine

    probe_engine = make_probe_engine(state.settings.database_url)
    ledger: Ledger = state.ledger
    try:
        while True:
            up = await asyncio.to_thread(state.database.probe, probe_engine)
            if up and len(ledger.journal):
                written = await asyncio.to_thread(ledger.replay)
                if written:
                    log.info("usage journal: %d entries written to the database", written)
            await asyncio.sleep(interval_s)
    finally:
        probe_engine.dispose()
