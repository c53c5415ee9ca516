"""Rate limits and budgets, with counters in the database shared by replicas."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from loraplex.platform import quotas
from loraplex.platform.db import crud
from loraplex.platform.db.models import RateCounter
from loraplex.platform.db.session import make_engine, make_sessionmaker
from loraplex.platform.usage import record_usage

NOW = datetime(2026, 3, 14, 15, 9, 26, 500000, tzinfo=UTC)  # 33.5 s before the next minute


def _charge(session, tenant, tokens=10, now=NOW):
    return quotas.check_and_charge(session, tenant.id, tokens=tokens, now=now)


def _counters(session):
    return session.scalar(select(func.count()).select_from(RateCounter))


def test_no_quota_means_unlimited_and_no_writes(session, tenant):
    assert all(_charge(session, tenant, tokens=10**9).allowed for _ in range(5))
    crud.set_quota(session, tenant_id=tenant.id, tokens_per_month=10**12)
    assert _charge(session, tenant).allowed
    assert _counters(session) == 0  # no per-minute limit: nothing to count


def test_requests_per_minute(session, tenant):
    crud.set_quota(session, tenant_id=tenant.id, requests_per_min=3)
    assert [_charge(session, tenant).allowed for _ in range(3)] == [True] * 3
    refused = _charge(session, tenant)
    assert not refused.allowed and refused.limit == "requests_per_min"
    assert refused.retry_after_s == 34  # up to the next minute, rounded up
    assert "3 requests per minute" in refused.reason
    assert _charge(session, tenant, now=NOW + timedelta(seconds=34)).allowed


def test_tokens_per_minute_and_adjustment(session, tenant):
    crud.set_quota(session, tenant_id=tenant.id, tokens_per_min=1000)
    assert _charge(session, tenant, tokens=900).allowed
    refused = _charge(session, tenant, tokens=200)
    assert not refused.allowed and refused.limit == "tokens_per_min"
    assert refused.retry_after_s == 34 and "900 used" in refused.reason

    # The request that reserved 900 used only 300: the other 600 become available.
    quotas.adjust_tokens(session, tenant.id, 300 - 900, now=NOW)
    assert _charge(session, tenant, tokens=700).allowed
    assert not _charge(session, tenant, tokens=1).allowed

    quotas.adjust_tokens(session, tenant.id, -(10**6), now=NOW)  # never below zero
    assert session.scalar(select(RateCounter.tokens)) == 0


def test_a_request_larger_than_the_limit_is_told_waiting_will_not_help(session, tenant):
    crud.set_quota(session, tenant_id=tenant.id, tokens_per_min=1000, tokens_per_month=5000)
    refused = _charge(session, tenant, tokens=1001)
    assert not refused.allowed and refused.retry_after_s is None
    assert "lower max_tokens" in refused.reason
    refused = _charge(session, tenant, tokens=6000)
    assert refused.limit == "tokens_per_month" and refused.retry_after_s is None
    crud.set_quota(session, tenant_id=tenant.id, requests_per_min=0)  # a tenant shut off
    refused = _charge(session, tenant)
    assert refused.limit == "requests_per_min" and refused.retry_after_s is None


def test_counters_are_shared_by_replicas(db_url, engine, tenant):
    # Two engines with their own pools, as two server processes would have.
    replicas = [make_engine(db_url) for _ in range(2)]
    makers = [make_sessionmaker(replica) for replica in replicas]
    try:
        with makers[0]() as s:
            crud.set_quota(s, tenant_id=tenant.id, requests_per_min=5)
        results = []
        for i in range(8):
            with makers[i % 2]() as s:
                results.append(_charge(s, tenant).allowed)
        assert results == [True] * 5 + [False] * 3
    finally:
        for replica in replicas:
            replica.dispose()


def test_concurrent_requests_never_exceed_the_limit(db_url, engine, session, tenant):
    crud.set_quota(session, tenant_id=tenant.id, requests_per_min=10, tokens_per_min=10**6)
    replica = make_engine(db_url, pool_size=8)
    maker = make_sessionmaker(replica)

    def attempt(_):
        with maker() as s:
            return _charge(s, tenant, tokens=7).allowed

    try:
        with ThreadPoolExecutor(8) as pool:
            allowed = sum(pool.map(attempt, range(40)))
    finally:
        replica.dispose()
    assert allowed == 10
    assert session.execute(select(RateCounter.requests, RateCounter.tokens)).one() == (10, 70)


def test_monthly_budget_counts_this_calendar_month_only(session, tenant):
    crud.set_quota(session, tenant_id=tenant.id, tokens_per_month=1000)
    for i, (when, tokens) in enumerate([(NOW - timedelta(days=30), 5000), (NOW, 900)]):
        record_usage(
            session, request_id=f"r{i}", tenant_id=tenant.id, model="demo", status="ok",
            prompt_tokens=tokens // 2, completion_tokens=tokens - tokens // 2, latency_ms=5,
            created_at=when,
        )  # fmt: skip
    assert quotas.monthly_tokens(session, tenant.id, now=NOW) == 900
    assert _charge(session, tenant, tokens=100).allowed
    refused = _charge(session, tenant, tokens=101)
    assert not refused.allowed and refused.limit == "tokens_per_month"
    april = datetime(2026, 4, 1, tzinfo=UTC)
    assert refused.retry_after_s == int((april - NOW).total_seconds()) + 1
    assert _charge(session, tenant, tokens=1000, now=april).allowed


def test_month_boundaries():
    assert quotas.next_month_start(datetime(2026, 12, 31, 23, 59, tzinfo=UTC)) == datetime(
        2027, 1, 1, tzinfo=UTC
    )
    assert quotas.month_start(NOW) == datetime(2026, 3, 1, tzinfo=UTC)


def test_old_counters_are_pruned(session, tenant):
    crud.set_quota(session, tenant_id=tenant.id, requests_per_min=100)
    _charge(session, tenant, now=NOW - timedelta(hours=2))
    _charge(session, tenant, now=NOW - timedelta(minutes=5))
    _charge(session, tenant, now=NOW)
    assert _counters(session) == 2


@pytest.mark.parametrize(
    ("rank", "size", "limit"),
    [(32, 10, "max_rank"), (8, 10, None), (8, 500, "max_adapter_bytes")],
)
def test_adapter_quota(session, tenant, rank, size, limit):
    crud.set_quota(session, tenant_id=tenant.id, max_rank=16, max_adapters=2, max_adapter_bytes=600)
    crud.create_adapter(
        session, tenant_id=tenant.id, name="a", base_model="demo", rank=8, alpha=8,
        targets=["q_proj"], bytes=200, sha256="ab" * 32, storage_key="k",
    )  # fmt: skip
    decision = quotas.check_adapter_quota(session, tenant.id, rank=rank, bytes=size)
    assert decision.allowed == (limit is None) and decision.limit == limit


def test_adapter_count_quota(session, tenant):
    crud.set_quota(session, tenant_id=tenant.id, max_adapters=1)
    assert quotas.check_adapter_quota(session, tenant.id, rank=8, bytes=1).allowed
    crud.create_adapter(
        session, tenant_id=tenant.id, name="a", base_model="demo", rank=8, alpha=8,
        targets=["q_proj"], bytes=1, sha256="ab" * 32, storage_key="k",
    )  # fmt: skip
    decision = quotas.check_adapter_quota(session, tenant.id, rank=8, bytes=1)
    assert decision.limit == "max_adapters" and "delete one" in decision.reason
