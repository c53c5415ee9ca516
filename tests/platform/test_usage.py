"""The usage ledger: one record per request, aggregates, exact billing and its exports."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import func, select

from loraplex.platform.db import crud
from loraplex.platform.db.models import GuardrailEvent, UsageRecord
from loraplex.platform.db.session import make_engine, make_sessionmaker
from loraplex.platform.usage import (
    BillingRow,
    billing_export,
    record_usage,
    to_csv,
    to_json,
    usage_summary,
)

DAY1 = datetime(2026, 3, 1, tzinfo=UTC)
DAY2 = DAY1 + timedelta(days=1)
PERIOD = dict(start=DAY1, end=DAY1 + timedelta(days=31))


def _record(session, tenant_id, request_id, prompt, completion, **extra):
    fields = dict(model="demo", status="ok", latency_ms=100.0, created_at=DAY1) | extra
    return record_usage(
        session, request_id=request_id, tenant_id=tenant_id, prompt_tokens=prompt,
        completion_tokens=completion, **fields,
    )  # fmt: skip


@pytest.fixture
def ledger(session, tenant):
    """acme: 3 requests over 2 days and 2 adapters; beta: 1 huge request; 1 outside the period."""
    beta = crud.create_tenant(session, name="beta", price_prompt_per_1k="0.000020001")
    _record(session, tenant.id, "a1", 1000, 300, adapter_name="pirate", cached_tokens=200)
    _record(session, tenant.id, "a2", 1, 33, adapter_name="pirate", status="aborted",
            created_at=DAY1 + timedelta(hours=23, minutes=59, seconds=59))  # fmt: skip
    _record(session, tenant.id, "a3", 0, 0, status="error", latency_ms=300.0,
            created_at=DAY2 + timedelta(seconds=1))  # fmt: skip
    _record(session, beta.id, "b1", 1_000_000, 0, created_at=DAY2)
    _record(session, tenant.id, "late", 7, 7, created_at=PERIOD["end"])  # the next period's
    return tenant, beta


def test_exactly_one_record_per_request_id(session, tenant):
    assert _record(session, tenant.id, "req-1", 10, 5) is True
    assert _record(session, tenant.id, "req-1", 999, 999, status="error") is False
    rows = session.execute(select(UsageRecord.prompt_tokens, UsageRecord.status)).all()
    assert rows == [(10, "ok")]  # the first record wins
    assert _record(session, tenant.id, "req-2", 1, 1) is True  # the session is still usable


def test_bad_records_are_refused(session, tenant):
    with pytest.raises(ValueError, match="'done'"):
        _record(session, tenant.id, "r", 1, 1, status="done")
    with pytest.raises(ValueError, match="completion=-1"):
        _record(session, tenant.id, "r", 1, -1)
    assert session.scalar(select(func.count()).select_from(UsageRecord)) == 0
    # More cached than prompt tokens is clamped, never a lost record.
    assert _record(session, tenant.id, "r", 4, 1, cached_tokens=5)
    assert session.scalar(select(UsageRecord.cached_tokens)) == 4


def test_summary_by_tenant(session, ledger):
    acme, beta = ledger
    by_tenant = usage_summary(session, **PERIOD, group_by="tenant")
    assert [(s.tenant, s.requests, s.prompt_tokens, s.completion_tokens) for s in by_tenant] == [
        ("acme", 3, 1001, 333),
        ("beta", 1, 1_000_000, 0),
    ]
    first = by_tenant[0]
    assert (first.cached_tokens, first.aborted, first.errors) == (200, 1, 1)
    assert first.avg_latency_ms == pytest.approx(500 / 3)
    only_beta = usage_summary(session, **PERIOD, tenant_id=beta.id)
    assert [s.tenant for s in only_beta] == ["beta"]


def test_summary_by_adapter_and_day(session, ledger):
    acme, _ = ledger
    by_adapter = usage_summary(session, **PERIOD, group_by="adapter", tenant_id=acme.id)
    assert [(s.adapter, s.requests, s.completion_tokens) for s in by_adapter] == [
        (None, 1, 0),  # the base model
        ("pirate", 2, 333),
    ]
    by_day = usage_summary(session, **PERIOD, group_by="day")
    assert [(s.day, s.requests) for s in by_day] == [(date(2026, 3, 1), 2), (date(2026, 3, 2), 2)]
    with pytest.raises(ValueError, match="group_by"):
        usage_summary(session, **PERIOD, group_by="model")


def test_days_are_utc_days_whatever_the_database_time_zone(db_url, engine, ledger):
    # A PostgreSQL session in Tokyo must still cut days at UTC midnight.
    args = {"connect_args": {"options": "-c timezone=Asia/Tokyo"}} if "postgres" in db_url else {}
    tokyo = make_engine(db_url, **args)
    try:
        with make_sessionmaker(tokyo)() as session:
            by_day = usage_summary(session, **PERIOD, group_by="day")
    finally:
        tokyo.dispose()
    assert [(s.day, s.requests) for s in by_day] == [(date(2026, 3, 1), 2), (date(2026, 3, 2), 2)]


def test_billing_costs_are_exact(session, ledger):
    acme_row, beta_row = billing_export(session, **PERIOD)
    # acme: 1001 prompt tokens at 0.0015/1k = 0.0015015 -> half-up to 0.001502;
    # 333 completion tokens at 0.002/1k = 0.000666.
    assert (acme_row.tenant, acme_row.requests) == ("acme", 3)
    assert acme_row.prompt_cost == Decimal("0.001502")
    assert acme_row.completion_cost == Decimal("0.000666")
    assert acme_row.cost == Decimal("0.002168")
    # beta: a million prompt tokens at 0.000020001/1k, with no float rounding on the way.
    assert beta_row.cost == Decimal("0.020001") and beta_row.completion_cost == Decimal(0)
    assert all(isinstance(r.cost, Decimal) for r in (acme_row, beta_row))
    assert acme_row.period_start == DAY1


def test_exports_keep_decimals_exact(session, ledger):
    rows = billing_export(session, **PERIOD)
    parsed = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert [(r["tenant"], r["cost"]) for r in parsed] == [
        ("acme", "0.002168"),
        ("beta", "0.020001"),
    ]
    assert parsed[0]["period_start"] == "2026-03-01T00:00:00+00:00"
    exported = json.loads(to_json(rows))
    assert exported[1]["price_prompt_per_1k"] == "0.000020001"
    assert exported[0]["prompt_tokens"] == 1001

    empty = to_csv(billing_export(session, start=DAY1 - timedelta(days=9), end=DAY1))
    assert empty.splitlines() == [",".join(BillingRow.__dataclass_fields__)]
    assert json.loads(to_json([])) == []


def test_billing_export_counts_guardrail_events_per_tenant(session, ledger):
    acme, beta = ledger
    gamma = crud.create_tenant(session, name="gamma")  # every request blocked: no usage at all
    events = [
        (acme, "block", DAY1),
        (acme, "block", DAY2),
        (acme, "redact", DAY2),
        (acme, "flag", PERIOD["end"]),
        (gamma, "block", DAY2),
        (gamma, "fail_open", DAY1),
    ]
    session.add_all(
        GuardrailEvent(tenant_id=t.id, policy_name="p", rule="term", stage="input", action=a,
                       request_id=f"r{i}", route="chat", created_at=when)
        for i, (t, a, when) in enumerate(events)
    )  # fmt: skip
    session.commit()
    parsed = {
        r["tenant"]: r
        for r in csv.DictReader(io.StringIO(to_csv(billing_export(session, **PERIOD))))
    }
    counted = (
        "guardrail_blocks",
        "guardrail_redactions",
        "guardrail_flags",
        "guardrail_fail_opens",
    )
    # acme's flag falls in the next period; beta had none; gamma is a zero-token row.
    assert {t: [r[c] for c in counted] for t, r in parsed.items()} == {
        "acme": ["2", "1", "0", "0"], "beta": ["0", "0", "0", "0"], "gamma": ["1", "0", "0", "1"],
    }  # fmt: skip
    assert (parsed["gamma"]["requests"], parsed["gamma"]["cost"]) == ("0", "0")
    assert json.loads(to_json(billing_export(session, **PERIOD)))[0]["guardrail_blocks"] == 2
    by_version = billing_export(session, **PERIOD, by="version")
    assert {r.guardrail_blocks for r in by_version} == {
        None
    }  # a count is a tenant's, not a version's
