"""The ledger through database outages (platform/ledger.py, platform/journal.py): every usage
record reaches the registry exactly once, the first record of a request id wins, and its quota
correction is applied with it and only with it, whatever the order of outages, lost commit
replies, replays and restarts of the server. A state machine draws those orders: a replay
that the database's going away cuts between two entries, writes arriving while the journal
holds entries, a restart with the journal full."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime

import hypothesis
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError, OperationalError

from loraplex.platform import ledger
from loraplex.platform.db import crud
from loraplex.platform.db.health import DatabaseHealth, is_unavailable
from loraplex.platform.db.models import QuotaRelease, RateCounter, UsageRecord
from loraplex.platform.db.session import make_engine, make_sessionmaker, upgrade
from loraplex.platform.journal import Journal

CHARGED = datetime(2026, 3, 1, 12, 0, 30, tzinfo=UTC)
REQUEST_IDS = [f"cmpl-{i}" for i in range(5)]
RELEASED_IDS = [f"cmpl-r{i}" for i in range(3)]  # requests that never ran: reservations back


def _refused(what: str) -> OperationalError:
    return OperationalError(what, {}, ConnectionRefusedError("connection refused"))


class FlakyDatabase:
    """Sessions of a real registry that can be made unreachable, go away after a number of
    sessions (mid-replay), or lose the reply to a commit that happened."""

    def __init__(self, sessions):
        self.sessions = sessions
        self.down = False
        self.down_after: int | None = None  # sessions left before it goes away
        self.lose_reply = False

    def __call__(self):
        if self.down_after is not None:
            self.down_after -= 1
            if self.down_after < 0:
                self.down, self.down_after = True, None
        if self.down:
            raise _refused("connect")
        session = self.sessions()
        if self.lose_reply:
            self.lose_reply = False
            commit = session.commit

            def commit_then_lose_reply():
                commit()
                raise OperationalError("commit", {}, ConnectionResetError("reply lost"))

            session.commit = commit_then_lose_reply
        return session


def _record(request_id: str, tenant_id: int, completion: int) -> dict:
    return dict(request_id=request_id, tenant_id=tenant_id, model="base", status="ok",
                prompt_tokens=3, completion_tokens=completion, latency_ms=1.0,
                created_at=datetime.now(UTC))  # fmt: skip


class LedgerThroughOutages(RuleBasedStateMachine):
    def __init__(self, sessions, tenant_id: int, journal_path):
        super().__init__()
        self.sessions, self.tenant_id, self.journal_path = sessions, tenant_id, journal_path
        with sessions() as s:
            s.execute(delete(UsageRecord))
            s.execute(delete(RateCounter))
            s.execute(delete(QuotaRelease))
            s.commit()
        journal_path.unlink(missing_ok=True)
        for suffix in ("-wal", "-shm"):
            journal_path.with_name(journal_path.name + suffix).unlink(missing_ok=True)
        self.db = FlakyDatabase(sessions)
        self.ledger = self._open()
        self.first: dict[str, tuple[int, int]] = {}  # request id -> (tokens, adjust) billed
        self.released: dict[str, int] = {}  # request id -> tokens given back

    def _open(self) -> ledger.Ledger:
        return ledger.Ledger(self.db, Journal(self.journal_path), DatabaseHealth())

    @rule(rid=st.sampled_from(REQUEST_IDS), tokens=st.integers(0, 50), adjust=st.integers(0, 9))
    def request_ends(self, rid, tokens, adjust):
        record = _record(rid, self.tenant_id, tokens)
        entry = ledger.usage_entry(record, tenant_id=self.tenant_id, adjust=adjust,
                                   charged_at=CHARGED)  # fmt: skip
        self.ledger.write(entry)  # never raises, whatever the database does
        self.first.setdefault(rid, (tokens, adjust))

    @rule(
        ends=st.lists(
            st.tuples(
                st.sampled_from(REQUEST_IDS + RELEASED_IDS), st.integers(0, 50), st.integers(0, 9)
            ),
            min_size=2,
            max_size=5,
        )
    )
    def requests_end_at_once(self, ends):
        """Entries that waited while another write ran, written as one batch (group commit):
        records, releases, and a key twice among them."""
        batch = []
        for rid, tokens, adjust in ends:
            if rid in RELEASED_IDS:
                batch.append(ledger.release_entry(rid, tenant_id=self.tenant_id, adjust=adjust,
                                                  charged_at=CHARGED))  # fmt: skip
                self.released.setdefault(rid, adjust)
            else:
                record = _record(rid, self.tenant_id, tokens)
                batch.append(ledger.usage_entry(record, tenant_id=self.tenant_id,
                                                adjust=adjust, charged_at=CHARGED))  # fmt: skip
                self.first.setdefault(rid, (tokens, adjust))
        self.ledger._write_batch(batch)  # what `write` calls with the entries that waited

    @rule(rid=st.sampled_from(RELEASED_IDS), tokens=st.integers(0, 9))
    def reservation_given_back(self, rid, tokens):
        # Positive here, so that the counter's floor at zero never hides a double release.
        self.ledger.write(ledger.release_entry(rid, tenant_id=self.tenant_id, adjust=tokens,
                                               charged_at=CHARGED))  # fmt: skip
        self.released.setdefault(rid, tokens)

    @rule()
    def database_goes(self):
        self.db.down = True

    @rule()
    def database_returns(self):
        self.db.down, self.db.down_after = False, None

    @rule(n=st.integers(0, 3))
    def database_goes_after(self, n):
        self.db.down_after = n

    @rule()
    def next_commit_reply_lost(self):
        self.db.lose_reply = True

    @rule()
    def replay(self):
        self.ledger.replay()

    @rule()
    def server_killed_and_restarted(self):
        self.ledger.close()
        self.ledger = self._open()

    def _db_rows(self) -> dict[str, tuple[int, int]]:
        with self.sessions() as s:
            rows = s.execute(select(UsageRecord.request_id, UsageRecord.completion_tokens))
            return {rid: tokens for rid, tokens in rows}

    def _releases(self) -> set[str]:
        with self.sessions() as s:
            return set(s.scalars(select(QuotaRelease.request_id)))

    def _counter(self) -> int:
        with self.sessions() as s:
            return s.scalar(select(RateCounter.tokens)) or 0

    @invariant()
    def billed_once_first_record_wins(self):
        rows = self._db_rows()
        journaled = {e.key for e in self.ledger.journal.oldest(1000)}
        releases = self._releases()
        assert set(rows) | {k for k in journaled if not k.startswith("release:")} == set(self.first)
        assert releases | {k.removeprefix("release:") for k in journaled
                           if k.startswith("release:")} == set(self.released)  # fmt: skip
        for rid, tokens in rows.items():
            assert tokens == self.first[rid][0], rid
        # Each record's correction applied with it, each release once: never twice.
        applied = sum(self.first[rid][1] for rid in rows)
        assert self._counter() == applied + sum(self.released[rid] for rid in releases)

    def teardown(self):
        self.db.down, self.db.down_after, self.db.lose_reply = False, None, False
        self.ledger.replay()
        assert len(self.ledger.journal) == 0
        assert self._db_rows() == {rid: t for rid, (t, _) in self.first.items()}
        assert self._releases() == set(self.released)
        given_back = sum(self.released.values())
        assert self._counter() == sum(a for _, a in self.first.values()) + given_back
        self.ledger.close()


def test_every_record_is_billed_once_through_outages_replays_and_restarts(tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(url)
    db = make_engine(url)
    sessions = make_sessionmaker(db)
    with sessions() as s:
        tenant = crud.create_tenant(s, name="acme")
        crud.set_quota(s, tenant_id=tenant.id, tokens_per_min=10**9)
        tenant_id = tenant.id
    journal = tmp_path / "usage-journal.db"
    settings = hypothesis.settings(max_examples=60, stateful_step_count=25, deadline=None,
                                   suppress_health_check=list(hypothesis.HealthCheck))  # fmt: skip
    try:
        run_state_machine_as_test(
            lambda: LedgerThroughOutages(sessions, tenant_id, journal), settings=settings
        )
    finally:
        db.dispose()


def test_the_journal_survives_a_crash_and_keeps_the_first_entry_of_a_key(tmp_path):
    path = tmp_path / "journal.db"
    journal = Journal(path)
    entry = ledger.release_entry("cmpl-1", tenant_id=1, adjust=-5, charged_at=CHARGED)
    assert journal.add(entry)
    assert not journal.add(ledger.release_entry("cmpl-1", tenant_id=1, adjust=-9,
                                                charged_at=CHARGED))  # fmt: skip
    # No close: what a killed server leaves. Another process reads it back whole.
    with sqlite3.connect(path) as other:
        assert other.execute("SELECT count(*) FROM entries").fetchone() == (1,)
    assert Journal(path).oldest() == [entry]


def test_a_record_the_database_refuses_is_logged_not_kept(tmp_path, caplog):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(url)
    db = make_engine(url)
    try:
        health = DatabaseHealth()
        book = ledger.Ledger(make_sessionmaker(db), Journal(tmp_path / "j.db"), health)
        # Tenant 404 does not exist: the foreign key refuses the record, now and on any retry.
        entry = ledger.usage_entry(_record("cmpl-x", 404, 1), tenant_id=404, adjust=0,
                                   charged_at=CHARGED)  # fmt: skip
        assert not book.write(entry)
        assert len(book.journal) == 0 and health.up
        assert "usage entry refused by the database" in caplog.text and "cmpl-x" in caplog.text
    finally:
        db.dispose()


def test_outage_errors_are_told_from_our_own():
    assert is_unavailable(_refused("connect"))
    assert not is_unavailable(IntegrityError("insert", {}, Exception("duplicate key")))
