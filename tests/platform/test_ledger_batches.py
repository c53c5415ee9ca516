"""The ledger's group commit (platform/ledger.py): requests ending at once are written in
shared transactions, and still each billed exactly once with its own quota correction."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

from sqlalchemy import event, select
from sqlalchemy.exc import OperationalError

from loraplex.platform import ledger
from loraplex.platform.db import crud
from loraplex.platform.db.health import DatabaseHealth
from loraplex.platform.db.models import RateCounter, UsageRecord
from loraplex.platform.db.session import make_engine, make_sessionmaker, upgrade
from loraplex.platform.journal import Journal
from loraplex.platform.quotas import minute_start

CHARGED = datetime(2026, 3, 1, 12, 0, 30, tzinfo=UTC)


def _entry(rid: str, tenant_id: int, completion: int, adjust: int) -> ledger.Entry:
    record = dict(request_id=rid, tenant_id=tenant_id, model="base", status="ok",
                  prompt_tokens=3, completion_tokens=completion, latency_ms=1.0,
                  created_at=datetime.now(UTC))  # fmt: skip
    return ledger.usage_entry(record, tenant_id=tenant_id, adjust=adjust, charged_at=CHARGED)


def test_requests_ending_at_once_share_transactions_and_are_each_billed_once(tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(url)
    db = make_engine(url)
    sessions = make_sessionmaker(db)
    with sessions() as s:
        tenant_id = crud.create_tenant(s, name="acme").id
        crud.set_quota(s, tenant_id=tenant_id, tokens_per_min=10**9)
        # Reserved beforehand: the corrections (all give back, as a finished request does)
        # can never reach the counter's floor, so the exact sum is what must remain.
        s.add(RateCounter(tenant_id=tenant_id, window_start=minute_start(CHARGED),
                          requests=0, tokens=100_000))  # fmt: skip
        s.commit()
    commits = []
    event.listen(db, "commit", lambda conn: commits.append(1))
    book = ledger.Ledger(sessions, Journal(tmp_path / "j.db"), DatabaseHealth())
    n = 96
    entries = [_entry(f"cmpl-{i}", tenant_id, i, -(i % 7)) for i in range(n)]
    entries.append(_entry("cmpl-5", tenant_id, 999, -50))  # a second record of a request
    start = threading.Barrier(len(entries))
    answers: list[bool] = [False] * len(entries)

    def end(i: int) -> None:
        start.wait()
        answers[i] = book.write(entries[i])

    threads = [threading.Thread(target=end, args=(i,)) for i in range(len(entries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(answers) and len(book.journal) == 0
        with sessions() as s:
            rows = dict(
                s.execute(select(UsageRecord.request_id, UsageRecord.completion_tokens)).all()
            )
            counter = s.scalar(select(RateCounter.tokens))
        # One record per request: for cmpl-5 whichever of its two came first, and only that
        # one's correction (5 % 7 given back, or 50).
        assert set(rows) == {f"cmpl-{i}" for i in range(n)} and rows["cmpl-5"] in (5, 999)
        assert all(rows[f"cmpl-{i}"] == i for i in range(n) if i != 5)
        given_back = sum(i % 7 for i in range(n) if i != 5) + (5 if rows["cmpl-5"] == 5 else 50)
        assert counter == 100_000 - given_back
        # Grouped: fewer transactions than requests (the threads all waited on the first).
        assert len(commits) < len(entries), len(commits)
    finally:
        book.close()
        db.dispose()


def test_one_refused_entry_in_a_batch_refuses_only_itself(tmp_path, caplog):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(url)
    db = make_engine(url)
    sessions = make_sessionmaker(db)
    with sessions() as s:
        tenant_id = crud.create_tenant(s, name="acme").id
    book = ledger.Ledger(sessions, Journal(tmp_path / "j.db"), DatabaseHealth())
    try:
        # Tenant 404 does not exist: its record breaks the batch's statement.
        batch = [_entry("cmpl-a", tenant_id, 1, 0), _entry("cmpl-x", 404, 1, 0),
                 _entry("cmpl-b", tenant_id, 2, 0)]  # fmt: skip
        assert book._write_batch(batch) == [True, False, True]
        with sessions() as s:
            assert set(s.scalars(select(UsageRecord.request_id))) == {"cmpl-a", "cmpl-b"}
        assert len(book.journal) == 0 and "cmpl-x" in caplog.text
    finally:
        book.close()
        db.dispose()


def _refused() -> OperationalError:
    return OperationalError("connect", {}, ConnectionRefusedError("connection refused"))


def test_a_write_stuck_on_a_database_gone_holds_no_other_back(tmp_path):
    """A write waiting on the database (until its timeout) when it goes: the entries that
    came meanwhile go to the journal as soon as the outage is known, not behind it."""
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(url)
    db = make_engine(url)
    real = make_sessionmaker(db)
    with real() as s:
        tenant_id = crud.create_tenant(s, name="acme").id
    stuck, released = threading.Event(), threading.Event()

    def sessions():
        if not stuck.is_set():  # the first write hangs on a connection, then fails
            stuck.set()
            released.wait(30)
            raise _refused()
        return real()

    health = DatabaseHealth()
    book = ledger.Ledger(sessions, Journal(tmp_path / "j.db"), health)
    first = threading.Thread(target=book.write, args=(_entry("cmpl-a", tenant_id, 1, 0),))
    first.start()
    try:
        assert stuck.wait(10)
        health.failed(_refused())  # the probe saw the database go
        t = time.monotonic()
        assert not book.write(_entry("cmpl-b", tenant_id, 1, 0))
        assert time.monotonic() - t < 5  # not held until the stuck write's timeout
        assert [e.key for e in book.journal.oldest()] == ["cmpl-b"]
    finally:
        released.set()
        first.join(30)
    assert {e.key for e in book.journal.oldest()} == {"cmpl-a", "cmpl-b"}  # nothing lost
    health.reached()
    assert book.replay() == 2
    with real() as s:
        assert set(s.scalars(select(UsageRecord.request_id))) == {"cmpl-a", "cmpl-b"}
    book.close()
    db.dispose()
