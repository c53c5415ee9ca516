"""Batch API usage in the ledger: recorded with its class, priced at the tenant's batch factor
(default 0.5) in columns of its own in the billing export, and counted by the token quotas."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from loraplex.platform import quotas
from loraplex.platform.db import crud
from loraplex.platform.db.models import Quota
from loraplex.platform.portal_service import tenant_usage
from loraplex.platform.usage import billing_export, record_usage, to_csv

DAY = datetime(2026, 3, 1, tzinfo=UTC)
PERIOD = {"start": DAY, "end": DAY + timedelta(days=1)}


def _record(session, tenant_id, rid, prompt, completion, request_class):
    record_usage(session, request_id=rid, tenant_id=tenant_id, model="m", prompt_tokens=prompt,
                 completion_tokens=completion, status="ok", latency_ms=1.0,
                 created_at=DAY + timedelta(hours=1), request_class=request_class)  # fmt: skip


def test_batch_tokens_are_billed_apart_at_the_factor(session, tenant):
    # tenant: 0.0015 per 1k prompt tokens, 0.002 per 1k completion tokens
    _record(session, tenant.id, "i1", 1000, 500, "interactive")
    _record(session, tenant.id, "b1", 2000, 1000, "batch")
    _record(session, tenant.id, "b2", 2000, 1000, "batch")
    (row,) = billing_export(session, **PERIOD)
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (3, 5000, 2500)
    assert (row.batch_requests, row.batch_prompt_tokens, row.batch_completion_tokens) == (
        2, 4000, 2000)  # fmt: skip
    assert row.prompt_cost == Decimal("0.0015") and row.completion_cost == Decimal("0.001")
    # 4000 x 0.0015/1k x 0.5 + 2000 x 0.002/1k x 0.5
    assert row.batch_price_factor == Decimal("0.5") and row.batch_cost == Decimal("0.005")
    assert row.cost == row.prompt_cost + row.completion_cost + row.batch_cost
    parsed = next(csv.DictReader(io.StringIO(to_csv([row]))))
    assert (parsed["batch_cost"], parsed["cost"]) == ("0.005000", "0.007500")

    tenant.batch_price_factor = Decimal("0.25")  # a tenant's own factor
    session.commit()
    (row,) = billing_export(session, **PERIOD)
    assert row.batch_cost == Decimal("0.0025") and row.cost == Decimal("0.005")


def test_the_portal_prices_batch_tokens_as_the_billing_export(session, tenant):
    _record(session, tenant.id, "i1", 1000, 500, "interactive")
    _record(session, tenant.id, "b1", 4000, 2000, "batch")
    (day,) = tenant_usage(session, tenant, PERIOD["start"], PERIOD["end"])
    (bill,) = billing_export(session, **PERIOD)
    assert (day.batch_requests, day.batch_prompt_tokens, day.batch_completion_tokens) == (
        1, 4000, 2000)  # fmt: skip
    assert (day.prompt_cost, day.completion_cost, day.batch_cost, day.cost) == (
        bill.prompt_cost, bill.completion_cost, bill.batch_cost, bill.cost)  # fmt: skip
    assert day.cost == Decimal("0.0075")  # at full price it would be 0.0125


def test_an_unknown_class_is_refused(session, tenant):
    with pytest.raises(ValueError, match="nightly"):
        _record(session, tenant.id, "x", 1, 1, "nightly")


def test_quotas_count_batch_tokens(session, tenant):
    crud.set_quota(session, tenant_id=tenant.id, tokens_per_month=10_000)
    now = datetime.now(UTC)
    record_usage(session, request_id="b", tenant_id=tenant.id, model="m", prompt_tokens=6000,
                 completion_tokens=3000, status="ok", latency_ms=1.0,
                 request_class="batch")  # fmt: skip
    assert quotas.monthly_tokens(session, tenant.id, now=now) == 9000
    assert not quotas.check_and_charge(session, tenant.id, tokens=2000, now=now).allowed


def test_a_batch_token_budget_of_its_own(session, tenant):
    """batch_tokens_per_month: batch lines meet it besides the tenant's other limits;
    interactive requests never do, and interactive tokens do not spend it."""
    crud.set_quota(session, tenant_id=tenant.id, tokens_per_month=100_000)
    quota = session.get(Quota, tenant.id)
    quota.batch_tokens_per_month = 5000
    session.commit()
    now = datetime.now(UTC)
    for rid, tokens, request_class in (("i", 20_000, "interactive"), ("b", 4000, "batch")):
        record_usage(session, request_id=rid, tenant_id=tenant.id, model="m", prompt_tokens=tokens,
                     completion_tokens=0, status="ok", latency_ms=1.0,
                     request_class=request_class)  # fmt: skip

    def charge(tokens: int, request_class: str) -> quotas.QuotaDecision:
        return quotas.check_and_charge(session, tenant.id, tokens=tokens, now=now,
                                       request_class=request_class)  # fmt: skip

    assert charge(1000, "batch").allowed and quotas.check_batch_budget(session, tenant.id).allowed
    refused = charge(1001, "batch")
    assert refused.limit == "batch_tokens_per_month" and refused.retry_after_s > 0
    assert "4000 of 5000" in refused.reason
    assert charge(50_000, "interactive").allowed  # the batch budget is the batch's alone
    record_usage(session, request_id="b2", tenant_id=tenant.id, model="m", prompt_tokens=1000,
                 completion_tokens=0, status="ok", latency_ms=1.0,
                 request_class="batch")  # fmt: skip
    # Spent: the batch runner holds the tenant's lines until next month.
    assert not quotas.check_batch_budget(session, tenant.id, now=now).allowed
    quota.batch_tokens_per_month = 10**9
    session.commit()
    assert charge(90_000, "batch").limit == "tokens_per_month"  # the others still hold
