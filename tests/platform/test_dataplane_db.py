"""What the serving path (both data planes) writes to the database per request: an adapter's
last use is recorded at most once a minute, and a request that has just read a recent use
in the adapter's row sends nothing at all, neither a statement nor a commit."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import event, update

from loraplex.platform.db import crud
from loraplex.platform.db.models import Adapter
from loraplex.platform.db.session import make_sessionmaker

NOW = datetime(2026, 3, 14, 15, 9, 26, tzinfo=UTC)
SHA = "cd" * 32


def test_a_recent_use_read_with_the_row_sends_nothing(engine, session, tenant):
    fields = dict(base_model="demo", rank=8, alpha=16.0, targets=["q_proj"], bytes=10,
                  sha256=SHA, storage_key=f"adapters/{SHA}")  # fmt: skip
    first = crud.create_adapter(session, tenant_id=tenant.id, name="sql", **fields)
    crud.touch_adapter_used(session, adapter_id=first.id, now=NOW)
    sent: list[str] = []
    commits: list[int] = []
    event.listen(engine, "before_cursor_execute", lambda *a: sent.append(a[2]))
    event.listen(engine, "commit", lambda *a: commits.append(1))

    # As a request does: read the row, then touch it.
    row = crud.get_adapter(session, tenant_id=tenant.id, name="sql")
    assert row.last_used_at == NOW
    before = len(sent)
    crud.touch_adapter_used(session, adapter_id=row.id, now=NOW + timedelta(seconds=30))
    assert len(sent) == before and not commits

    # A minute on, the same row read earlier: written (one conditional UPDATE, committed).
    crud.touch_adapter_used(session, adapter_id=row.id, now=NOW + timedelta(minutes=2))
    assert [s.split()[0] for s in sent[before:]] == ["UPDATE"] and commits == [1]
    session.expire_all()
    assert crud.get_adapter(session, tenant_id=tenant.id, name="sql").last_used_at == (
        NOW + timedelta(minutes=2)
    )

    # Another replica's session, holding a row read before that write: its UPDATE matches
    # nothing (the use is under a minute old in the database), so the value stays.
    with make_sessionmaker(engine)() as other:
        stale = crud.get_adapter(other, tenant_id=tenant.id, name="sql")
        session.execute(update(Adapter).values(last_used_at=NOW + timedelta(minutes=3)))
        session.commit()
        assert stale.last_used_at == NOW + timedelta(minutes=2)
        later = NOW + timedelta(minutes=3, seconds=30)
        crud.touch_adapter_used(other, adapter_id=stale.id, now=later)
    session.expire_all()
    got = crud.get_adapter(session, tenant_id=tenant.id, name="sql").last_used_at
    assert got == NOW + timedelta(minutes=3)
