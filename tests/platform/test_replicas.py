"""Two `loraplex serve` processes on one PostgreSQL database and one S3 endpoint (moto's
server), as the Helm chart runs them: what one replica changes, the other sees at once, and
limits and the ledger hold for the fleet, not per replica."""

from __future__ import annotations

import concurrent.futures as cf
import time
from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import func, select

from loraplex.platform.db.models import UsageRecord
from tests.utils.fleet import complete, new_tenant, received_usage
from tests.utils.server import ADMIN_KEY
from tests.utils.uploads import auth, folder_parts, upload

pytestmark = pytest.mark.slow


def test_what_replica_a_changes_replica_b_sees_at_once(replicas):
    a, b, _, folders, _ = replicas
    _, key_id, key = new_tenant(a, "propagation")
    base = complete(b, key, "llama").json()["choices"][0]["text"]

    assert upload(a, key, "x", folder_parts(folders["x"])).status_code == 201
    uploaded = time.monotonic()
    on_b = complete(b, key, "x")
    served_after = time.monotonic() - uploaded
    assert on_b.status_code == 200, on_b.text
    text_b = on_b.json()["choices"][0]["text"]
    assert text_b == complete(a, key, "x").json()["choices"][0]["text"] != base

    deleted = httpx.delete(f"{a}/v1/adapters/x", headers=auth(key), timeout=30)
    assert deleted.status_code == 200, deleted.text
    gone = time.monotonic()
    refused = complete(b, key, "x")
    refused_after = time.monotonic() - gone
    assert refused.status_code == 404, refused.text  # B still has its bytes on disk
    assert refused.json()["error"]["code"] == "model_not_found"

    revoked = httpx.post(f"{a}/admin/api/keys/{key_id}/revoke", headers=auth(ADMIN_KEY))
    assert revoked.status_code == 200, revoked.text
    t = time.monotonic()
    locked_out = complete(b, key, "llama")
    revoked_after = time.monotonic() - t
    assert locked_out.status_code == 401, locked_out.text
    print(f"upload on A -> served by B in {served_after:.3f}s (first request, incl. the S3 "
          f"fetch); delete on A -> 404 on B in {refused_after:.3f}s; revoke on A -> 401 on B "
          f"in {revoked_after:.3f}s")  # fmt: skip


def test_a_requests_per_min_cap_holds_across_replicas(replicas):
    a, b, sessions, _, _ = replicas
    cap, sent = 6, 16
    tenant_id, _, key = new_tenant(a, "capped", quota={"requests_per_min": cap})
    now = datetime.now(UTC)
    if now.second >= 50:  # the burst must fall in one counter minute
        time.sleep(60.5 - now.second - now.microsecond / 1e6)
    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: complete((a, b)[i % 2], key, "llama", max_tokens=1),
                                  range(sent)))  # fmt: skip
    codes = [r.status_code for r in responses]
    admitted = codes.count(200)
    print(f"requests_per_min={cap}: {sent} concurrent to 2 replicas -> {admitted} admitted "
          f"(A {codes[0::2].count(200)}, B {codes[1::2].count(200)}), overshoot "
          f"{admitted - cap}")  # fmt: skip
    assert admitted == cap and codes.count(429) == sent - cap, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1
    with sessions() as session:
        billed = session.scalar(select(func.count()).where(UsageRecord.tenant_id == tenant_id))
    assert billed == cap  # refused requests leave no usage record


def test_usage_ledger_equals_what_clients_received_across_replicas(replicas):
    a, b, sessions, folders, _ = replicas
    tenant_id, _, key = new_tenant(a, "metered")
    assert upload(b, key, "y", folder_parts(folders["y"])).status_code == 201
    jobs = [(url, model, stream) for url in (a, b) for model in ("y", "llama")
            for stream in (False, True)] * 3  # fmt: skip
    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda j: complete(j[0], key, j[1], max_tokens=6,
                                                     stream=j[2]), jobs))  # fmt: skip
    assert [r.status_code for r in responses] == [200] * len(jobs), [r.text for r in responses]
    received = {rid: (p, c) for rid, p, c in map(received_usage, responses)}
    with sessions() as session:
        rows = session.execute(
            select(UsageRecord.request_id, UsageRecord.prompt_tokens,
                   UsageRecord.completion_tokens).where(UsageRecord.tenant_id == tenant_id)
        ).all()  # fmt: skip
    ledger = {rid: (p, c) for rid, p, c in rows}
    assert ledger == received
    print(f"ledger across 2 replicas: {len(ledger)} records, "
          f"{sum(c for _, c in ledger.values())} completion tokens = received")  # fmt: skip
