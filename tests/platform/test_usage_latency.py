"""Latency in the usage ledger: migration 0003 keeps old rows, and served requests record their
queue, TTFT, TPOT and end-to-end times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import inspect, select, text

from loraplex.platform.db import crud
from loraplex.platform.db.models import UsageRecord
from loraplex.platform.db.session import downgrade, make_engine, upgrade
from loraplex.platform.latency_stats import latency_stats
from loraplex.platform.usage import record_usage
from tests.utils.server import ADMIN_KEY, run_server

NEW = {"queue_ms", "tpot_ms"}


def _columns(engine) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns("usage_records")}


def test_migration_0003_keeps_rows_both_ways(db_url):
    upgrade(db_url, "0002")
    engine = make_engine(db_url)
    try:
        with engine.begin() as c:
            c.execute(text("INSERT INTO tenants (name, weight, price_prompt_per_1k, "
                           "price_completion_per_1k, status, created_at) VALUES "
                           "('acme', 1, 0, 0, 'active', '2026-12-01 00:00:00')"))  # fmt: skip
            c.execute(text("INSERT INTO usage_records (request_id, tenant_id, model, "
                           "prompt_tokens, completion_tokens, cached_tokens, status, ttft_ms, "
                           "latency_ms, created_at) VALUES ('r1', 1, 'demo', 3, 4, 0, 'ok', "
                           "12.5, 40, '2026-12-01 00:00:00')"))  # fmt: skip
        assert not NEW & _columns(engine)

        upgrade(db_url, "0003")
        assert _columns(engine) >= NEW
        with engine.connect() as c:
            row = c.execute(text("SELECT ttft_ms, latency_ms, queue_ms, tpot_ms "
                                 "FROM usage_records")).one()  # fmt: skip
        assert tuple(row) == (12.5, 40.0, None, None)  # old rows: no such timings

        downgrade(db_url, "0002")
        assert not NEW & _columns(engine)
        with engine.connect() as c:
            assert c.execute(text("SELECT request_id, ttft_ms FROM usage_records")).all() == [
                ("r1", 12.5)
            ]
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("srv")) as srv:
        yield srv


def _complete(server, key, **body) -> httpx.Response:
    body = {"model": server.state.model_name, "prompt": "The quick brown", "temperature": 0,
            "ignore_eos": True} | body  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    return r


def _record(server, request_id: str) -> UsageRecord:
    with server.sessions() as session:
        return session.scalars(
            select(UsageRecord).where(UsageRecord.request_id == request_id)
        ).one()


@pytest.mark.parametrize("stream", [False, True])
def test_served_requests_record_their_latencies(server, stream):
    _, key = server.new_tenant(f"lat-{stream}")
    r = _complete(server, key, max_tokens=12, stream=stream)
    rid = r.json()["id"] if not stream else r.text.split('"id": "', 1)[1].split('"', 1)[0]
    row = _record(server, rid)
    assert row.completion_tokens == 12
    assert 0 < row.ttft_ms < row.latency_ms
    assert row.tpot_ms > 0
    # The parts add up: first token, then 11 more at the mean TPOT, within the request's time.
    assert row.ttft_ms + 11 * row.tpot_ms == pytest.approx(row.latency_ms, rel=0.05, abs=2.0)
    # The engine's own queue wait (RequestOutput.metrics) lies within the time to first token.
    assert row.queue_ms is not None and 0 <= row.queue_ms <= row.ttft_ms


def test_one_token_has_no_tpot(server):
    _, key = server.new_tenant("lat-one")
    row = _record(server, _complete(server, key, max_tokens=1).json()["id"])
    assert row.completion_tokens == 1 and row.ttft_ms is not None and row.tpot_ms is None


def test_latency_percentiles_per_bucket_tenant_and_adapter(session, tenant):
    beta = crud.create_tenant(session, name="beta")
    t0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

    def add(rid, tenant_id, at, ttft, tpot, **kw):
        record_usage(session, request_id=rid, tenant_id=tenant_id, model="m", prompt_tokens=1,
                     completion_tokens=2, latency_ms=1000, created_at=at, ttft_ms=ttft,
                     tpot_ms=tpot, **{"status": "ok"} | kw)  # fmt: skip

    for i in range(10):  # 12:00-12:05, acme: TTFT 10..100 ms, TPOT 1..10 ms, on adapter "a"
        add(f"a{i}", tenant.id, t0 + timedelta(seconds=i), 10.0 * (i + 1), i + 1.0,
            adapter_name="a", queue_ms=float(i))  # fmt: skip
    add("b1", beta.id, t0 + timedelta(minutes=6), 500.0, None)  # one token: no TPOT
    add("b2", beta.id, t0 + timedelta(minutes=7), None, None, status="error")
    add("late", beta.id, t0 + timedelta(minutes=10), 1.0, 1.0)  # outside the period

    period = dict(start=t0, end=t0 + timedelta(minutes=10))
    series = latency_stats(session, **period, by="time", bucket_s=300)
    assert [s.key for s in series] == [t0, t0 + timedelta(minutes=5)]
    first, second = series
    assert (first.requests, first.errors) == (10, 0)
    # As PostgreSQL's percentile_cont, on both backends: linear between the nearest ranks.
    assert first.ttft_p50 == pytest.approx(55.0) and first.ttft_p99 == pytest.approx(99.1)
    assert first.tpot_p50 == pytest.approx(5.5) and first.queue_p99 == pytest.approx(8.91)
    assert (second.requests, second.errors, second.ttft_p99, second.tpot_p50) == (
        2, 1, pytest.approx(500.0), None)  # fmt: skip

    by_tenant = {s.key: s for s in latency_stats(session, **period, by="tenant")}
    assert by_tenant[tenant.id].requests == 10 and by_tenant[beta.id].ttft_p50 == 500.0
    only_a = latency_stats(session, **period, by="time", bucket_s=300, adapter="a")
    assert [s.requests for s in only_a] == [10]
    base = latency_stats(session, **period, by="tenant", base_model=True)
    assert [(s.key, s.requests) for s in base] == [(beta.id, 2)]
    assert latency_stats(session, **period, by="tenant", tenant_id=beta.id)[0].requests == 2
    by_adapter = latency_stats(session, **period, by="adapter")
    assert [(s.key, s.requests) for s in by_adapter] == [(None, 2), ("a", 10)]
    assert by_adapter[1].ttft_p99 == pytest.approx(99.1)


def test_latency_overview_endpoint(server):
    tenant_id, key = server.new_tenant("lat-overview", requests_per_min=1)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def tenant_row() -> dict | None:
        r = httpx.get(f"{server.url}/admin/api/latency", headers=admin)
        return next((t for t in r.json()["tenants"] if t["tenant_id"] == tenant_id), None)

    # 429s are counted in this replica's memory by tenant id, and the shared test server may
    # have seen an earlier test's tenant under the same id: count from here on.
    before = (tenant_row() or {}).get("refused", 0)
    _complete(server, key, max_tokens=3)
    refused = httpx.post(f"{server.url}/v1/completions",
                         json={"model": server.state.model_name, "prompt": "x", "max_tokens": 1},
                         headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert refused.status_code == 429
    r = httpx.get(f"{server.url}/admin/api/latency", params={"tenant_id": tenant_id},
                  headers=admin)  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["bucket_s"] == 60 and sum(p["requests"] for p in body["series"]) == 1
    assert body["series"][-1]["ttft_p99_ms"] > 0
    row = next(t for t in body["tenants"] if t["tenant_id"] == tenant_id)
    assert (row["requests"], row["refused"] - before) == (1, 1)
    assert row["refused_rate"] == row["refused"] / (row["refused"] + 1)
    assert row["ttft_p99_before_ms"] is None  # nothing in the hour before
    bad = httpx.get(f"{server.url}/admin/api/latency", params={"window": "2h"}, headers=admin)
    assert bad.status_code in (400, 422) and "error" in bad.json()
    gone = httpx.get(f"{server.url}/admin/api/latency", params={"tenant_id": 99999},
                     headers=admin)  # fmt: skip
    assert gone.status_code == 404
