"""Latency from the usage ledger, for the admin overview and the tenant portal: requests per
time bucket, tenant or adapter with their TTFT / TPOT / queue percentiles (interactive requests
only; the same half-open UTC periods as the ledger's other aggregates, platform/usage.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import ColumnElement, Integer, case, func, select
from sqlalchemy.orm import Session

from loraplex.platform.db.models import RequestClass, UsageRecord, UsageStatus
from loraplex.platform.usage import as_utc, in_period


@dataclass(frozen=True)
class LatencyStats:
    """Requests of one time bucket (or one tenant) and their latency percentiles, in ms;
    None where no request of the group has that timing."""

    key: Any  # the bucket's start (datetime), the tenant id or the adapter name (None: base)
    requests: int
    errors: int
    aborted: int
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    queue_p99: float | None


def _percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the nearest ranks, as PostgreSQL's percentile_cont."""
    if not values:
        return None
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _epoch(session: Session) -> ColumnElement[float]:
    if session.get_bind().dialect.name == "postgresql":
        return func.extract("epoch", UsageRecord.created_at)
    return func.cast(func.strftime("%s", UsageRecord.created_at), Integer)  # UTC text


def latency_stats(
    session: Session,
    *,
    start: datetime,
    end: datetime,
    by: Literal["time", "tenant", "adapter"],
    bucket_s: int = 300,
    tenant_id: int | None = None,
    adapter: str | None = None,
    base_model: bool = False,
) -> list[LatencyStats]:
    """p50/p99 TTFT and TPOT (and p99 queue time) of the interactive requests in [start, end),
    per time bucket of `bucket_s` seconds (buckets without requests left out), per tenant or
    per adapter name (the base model first); for one
    tenant, one adapter name (`adapter`) or the base model only (`base_model`).

    PostgreSQL computes the percentiles itself (percentile_cont); on SQLite the timings are
    read and ranked here, with the same interpolation."""
    start, end = as_utc(start), as_utc(end)
    # Interactive requests only: a Batch API line waits for idle capacity by design, and its
    # latency would hide (or fake) the interactive latency these figures watch.
    where = [*in_period(start, end), UsageRecord.request_class == RequestClass.interactive.value]
    if tenant_id is not None:
        where.append(UsageRecord.tenant_id == tenant_id)
    if adapter is not None:
        where.append(UsageRecord.adapter_name == adapter)
    elif base_model:
        where.append(UsageRecord.adapter_name.is_(None))
    if by == "time":
        if bucket_s < 1:
            raise ValueError("bucket_s must be at least 1")
        group: ColumnElement[Any] = func.floor(_epoch(session) / bucket_s).label("g")
    elif by == "tenant":
        group = UsageRecord.tenant_id.label("g")
    else:
        group = UsageRecord.adapter_name.label("g")
    counts = [
        func.count().label("requests"),
        func.sum(case((UsageRecord.status == UsageStatus.error.value, 1), else_=0)).label("e"),
        func.sum(case((UsageRecord.status == UsageStatus.aborted.value, 1), else_=0)).label("a"),
    ]
    timings = (UsageRecord.ttft_ms, UsageRecord.tpot_ms, UsageRecord.queue_ms)
    postgres = session.get_bind().dialect.name == "postgresql"
    if postgres:
        pct = [
            func.percentile_cont(q).within_group(col)
            for col, q in ((timings[0], 0.5), (timings[0], 0.99), (timings[1], 0.5),
                           (timings[1], 0.99), (timings[2], 0.99))
        ]  # fmt: skip
        query = (
            select(group, *counts, *pct).where(*where).group_by(group).order_by(group.nulls_first())
        )
        rows = [(r[0], r[1], r[2], r[3], *r[4:]) for r in session.execute(query)]
    else:
        summary = {
            r[0]: r[1:]
            for r in session.execute(select(group, *counts).where(*where).group_by(group))
        }
        values: dict[Any, tuple[list[float], list[float], list[float]]] = {
            g: ([], [], []) for g in summary
        }
        for g, ttft, tpot, queue in session.execute(select(group, *timings).where(*where)):
            for bucket, v in zip(values[g], (ttft, tpot, queue), strict=True):
                if v is not None:
                    bucket.append(v)
        rows = []
        for g in sorted(summary, key=lambda g: (g is not None, g)):  # None (base) first
            ttfts, tpots, queues = values[g]
            rows.append((g, *summary[g], _percentile(ttfts, 0.5), _percentile(ttfts, 0.99),
                         _percentile(tpots, 0.5), _percentile(tpots, 0.99),
                         _percentile(queues, 0.99)))  # fmt: skip

    def plain(v: Any) -> float | None:
        return None if v is None else float(v)

    out = []
    for g, n, e, a, t50, t99, p50, p99, q99 in rows:
        if by == "time":
            key = datetime.fromtimestamp(int(g) * bucket_s, UTC)
        else:
            key = int(g) if by == "tenant" else g
        out.append(LatencyStats(key, int(n), int(e or 0), int(a or 0), plain(t50), plain(t99),
                                plain(p50), plain(p99), plain(q99)))  # fmt: skip
    return out
