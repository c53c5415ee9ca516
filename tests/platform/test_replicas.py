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


def _text(url: str, key: str, model: str, **kw) -> str:
    response = complete(url, key, model, **kw)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_alias_changes_on_one_replica_steer_the_other_at_once(replicas):
    """Versions of one name on A; canary split, promote and rollback made on one replica
    decide what the other answers with on its very next request, and the ledger names the
    version that answered each."""
    a, b, sessions, folders, _ = replicas
    tenant_id, _, key = new_tenant(a, "canary")
    for folder in (folders["x"], folders["y"]):  # v1, then v2 (not promoted)
        assert upload(a, key, "bot", folder_parts(folder)).status_code == 201
    v1, v2 = _text(b, key, "bot@v1"), _text(b, key, "bot@v2")
    assert v1 != v2 and _text(b, key, "bot") == v1

    alias = f"{a}/v1/adapters/bot/aliases/default"
    split = httpx.put(alias, json={"weights": {"v1": 50, "v2": 50}}, headers=auth(key))
    assert split.status_code == 200, split.text
    seen = {user: _text(b, key, "bot", user=user) for user in ("u1", "u2", "u3", "u4", "u5")}
    for user, text in seen.items():  # sticky: each end user keeps their version, on A too
        assert text in (v1, v2) and _text(a, key, "bot", user=user) == text
    started = time.monotonic()
    promoted = httpx.put(alias, json={"version": "v2"}, headers=auth(key))
    assert promoted.status_code == 200 and promoted.json()["previous"] == {"v1": 50, "v2": 50}
    assert _text(b, key, "bot") == v2
    rolled = httpx.post(f"{b}/v1/adapters/bot/aliases/default/rollback", headers=auth(key))
    assert rolled.status_code == 200 and rolled.json()["weights"] == {"v1": 50, "v2": 50}
    assert all(_text(a, key, "bot", user=u) == text for u, text in seen.items())
    print(
        f"promote on A, then rollback on B: both served by the other replica within "
        f"{time.monotonic() - started:.3f}s"
    )

    refused = httpx.delete(f"{b}/v1/adapters/bot/versions/v1", headers=auth(key))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "version_in_use"
    with sessions() as session:
        versions = session.execute(
            select(UsageRecord.adapter_version, func.count())
            .where(UsageRecord.tenant_id == tenant_id)
            .group_by(UsageRecord.adapter_version)
        ).all()
    answered = dict(versions)
    # pinned 2, default 1, sticky 5 on B and 5 on A, promoted 1, rolled back 5
    assert set(answered) == {1, 2} and sum(answered.values()) == 19


def test_each_replica_lists_both_engines_by_their_heartbeats(replicas):
    a, b, _, _, _ = replicas

    def listed(url: str) -> dict:
        deadline = time.monotonic() + 10  # a beat every 0.5 s (fleet_settings)
        while True:
            r = httpx.get(f"{url}/admin/api/replicas", headers=auth(ADMIN_KEY), timeout=10)
            assert r.status_code == 200, r.text
            body = r.json()
            peers = [x for x in body["data"][1:] if not x["stale"]]
            if peers or time.monotonic() > deadline:
                return body
            time.sleep(0.1)

    for url, peer in ((a, b), (b, a)):
        body = listed(url)
        this, rows = body["data"][0], body["data"][1:]
        assert body["shared"] is True and this["this"] is True, body
        assert f":{url.rsplit(':', 1)[1]}:" in this["id"] and this["alive"], this
        (other,) = [x for x in rows if f":{peer.rsplit(':', 1)[1]}:" in x["id"]]
        assert other["this"] is False and other["stale"] is False and other["alive"], other
        assert other["id"] != this["id"] and other["seen_s_ago"] < 1.5
        assert {"running", "waiting", "kv_usage", "resident_adapters"} <= other.keys()
