"""Batch jobs in the registry without a server, on SQLite and PostgreSQL: two runners racing
for a batch (one lease wins, a dead one's lease is taken over once it runs out), a line
answered twice keeps its first answer, and an expired batch's error file names every line it
never ran."""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace

from loraplex.platform.batch_runner import BatchRunner
from loraplex.platform.batches import (
    BatchCreate,
    create_batch,
    final_state,
    record_line,
    write_result_files,
)
from loraplex.platform.db import crud
from loraplex.platform.db.models import ApiKey, Batch, BatchStatus, StoredFile, utcnow
from loraplex.platform.db.session import make_sessionmaker
from loraplex.platform.files import FileBlobs, create_file
from loraplex.platform.settings import Settings
from loraplex.platform.state import Caller
from loraplex.platform.store import LocalStore


def _batch(session, tenant, tmp_path, n: int = 3) -> tuple[Batch, FileBlobs, str]:
    blobs = FileBlobs(LocalStore(tmp_path / "store"))
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": "p"}} for i in range(n)]  # fmt: skip
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = create_file(session, blobs, tenant_id=tenant.id, purpose="batch", filename="in.jsonl",
                    data=data, lines=n)  # fmt: skip
    _, key = crud.create_key(session, tenant_id=tenant.id)
    caller = Caller(tenant=tenant, key=session.get(ApiKey, key.id))
    body = BatchCreate(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    return create_batch(session, caller=caller, body=body), blobs, f.storage_key


def test_one_runner_holds_a_batch_until_its_lease_runs_out(engine, session, tenant, tmp_path):
    batch, _, _ = _batch(session, tenant, tmp_path)
    state = SimpleNamespace(sessions=make_sessionmaker(engine),
                            settings=Settings(data_dir=tmp_path, batch_lease_s=30))  # fmt: skip
    a, b = BatchRunner(state), BatchRunner(state)
    assert a._claim() == batch.id
    assert b._claim() is None  # held
    assert b._renew(batch.id) is None and a._renew(batch.id)[0] == "validating"
    # a dies: its lease runs out, and b takes the batch over.
    session.execute(Batch.__table__.update().values(lease_until=utcnow() - timedelta(seconds=1)))
    session.commit()
    assert b._claim() == batch.id
    assert a._renew(batch.id) is None  # a, back, knows it lost it


def test_a_line_keeps_its_first_answer(session, tenant, tmp_path):
    batch, blobs, key = _batch(session, tenant, tmp_path)
    record_line(session, batch.id, 0, True, '{"first": 1}')
    record_line(session, batch.id, 0, False, '{"second": 1}')
    files, answered, failed = write_result_files(session, blobs, batch,
                                                 BatchStatus.completed, key)  # fmt: skip
    assert (answered, failed) == (1, 0) and set(files) == {"output"}
    out = session.get(StoredFile, files["output"])
    assert blobs.get(out.storage_key) == b'{"first": 1}\n'
    # Written again after a crash: the same file, not a second one.
    again, _, _ = write_result_files(session, blobs, batch, BatchStatus.completed, key)
    assert again == files


def test_an_expired_batch_lists_the_lines_it_never_ran(session, tenant, tmp_path):
    batch, blobs, key = _batch(session, tenant, tmp_path, n=4)
    record_line(session, batch.id, 1, True, json.dumps({"custom_id": "c1"}))
    batch.expires_at = utcnow() - timedelta(minutes=1)
    session.commit()
    final = final_state(batch, expired=False)
    assert final == BatchStatus.expired
    files, answered, failed = write_result_files(session, blobs, batch, final, key)
    errors = blobs.get(session.get(StoredFile, files["error"]).storage_key).decode().splitlines()
    rows = [json.loads(x) for x in errors]
    assert sorted(r["custom_id"] for r in rows) == ["c0", "c2", "c3"]
    assert {r["error"]["code"] for r in rows} == {"batch_expired"} and answered == 1


def test_a_suspended_tenants_batch_waits_unclaimed(engine, session, tenant, tmp_path):
    batch, _, _ = _batch(session, tenant, tmp_path)
    state = SimpleNamespace(sessions=make_sessionmaker(engine),
                            settings=Settings(data_dir=tmp_path))  # fmt: skip
    runner = BatchRunner(state)
    crud.update_tenant(session, tenant_id=tenant.id, status="suspended")
    assert runner._claim() is None
    crud.update_tenant(session, tenant_id=tenant.id, status="active")
    assert runner._claim() == batch.id
    crud.update_tenant(session, tenant_id=tenant.id, status="suspended")
    assert runner._renew(batch.id)[2] == "suspended"  # the running batch stops at its next beat
