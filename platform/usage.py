"""The usage ledger: one record per request, aggregates for admins, billing exports.

Periods are half-open, `start <= created_at < end`, in UTC, so consecutive periods never
count a request twice. Every delivered token is billed whatever the request's status (an
aborted stream was still generated and sent); cached tokens are a part of the prompt tokens,
reported but billed at the prompt price.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, Literal

from sqlalchemy import ColumnElement, case, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loraplex.platform.db.models import RequestClass, Tenant, UsageRecord, UsageStatus
from loraplex.platform.guardrails.audit import counts as guardrail_counts

COST_QUANTUM = Decimal("0.000001")  # costs are rounded half-up to 6 decimal places
GroupBy = Literal["tenant", "adapter", "version", "day"]
BillingBy = Literal["tenant", "version"]


def record_usage(session: Session, *, commit: bool = True, **record: Any) -> bool:
    """Write the request's record (`record`: `record_values`'s fields); True if written,
    False if its `request_id` already had one.

    The first record of a request wins, so a retried or duplicated "request finished" path
    cannot bill a request twice. Commits, unless `commit` is false (the ledger writes the
    record and its quota correction in one transaction: platform/ledger.py).
    """
    values = record_values(**record)
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    # ON CONFLICT DO NOTHING instead of catching IntegrityError: no rollback of the caller's
    # session, and no error logged by PostgreSQL for an expected duplicate.
    inserted = session.execute(
        dialect.insert(UsageRecord)
        .values(**values)
        .on_conflict_do_nothing(index_elements=[UsageRecord.request_id])
        .returning(UsageRecord.id)
    ).scalar_one_or_none()
    if commit:
        session.commit()
    return inserted is not None


def record_values(
    *,
    request_id: str,
    tenant_id: int,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    status: UsageStatus | str,
    latency_ms: float,
    api_key_id: int | None = None,
    adapter_name: str | None = None,
    adapter_version: int | None = None,
    end_user: str | None = None,
    cached_tokens: int = 0,
    queue_ms: float | None = None,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
    created_at: datetime | None = None,
    request_class: RequestClass | str = RequestClass.interactive,
) -> dict[str, Any]:
    """A usage row's column values, checked (`record_usage`'s arguments)."""
    status = UsageStatus(status).value  # ValueError names the bad status
    request_class = RequestClass(request_class).value
    if min(prompt_tokens, completion_tokens, cached_tokens) < 0:
        raise ValueError(
            f"negative token counts for {request_id}: prompt={prompt_tokens} "
            f"completion={completion_tokens} cached={cached_tokens}"
        )
    # Cached tokens are informational; an engine counting a whole cached block must not cost
    # the request its (billed) record.
    cached_tokens = min(cached_tokens, prompt_tokens)
    values: dict[str, Any] = dict(
        request_id=request_id,
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        adapter_name=adapter_name,
        adapter_version=adapter_version,
        end_user=end_user,
        model=model,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        status=status,
        request_class=request_class,
        queue_ms=queue_ms,
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        latency_ms=latency_ms,
    )
    if created_at is not None:
        values["created_at"] = created_at
    return values


@dataclass(frozen=True)
class UsageSummary:
    """One group of `usage_summary`; the fields not grouped on are None."""

    tenant_id: int | None
    tenant: str | None
    adapter: str | None  # None is the base model (in "adapter" grouping)
    day: date | None
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    aborted: int
    errors: int
    avg_latency_ms: float | None
    version: int | None = None  # the adapter version (in "version" grouping)


def _day(session: Session) -> ColumnElement[str]:
    if session.get_bind().dialect.name == "postgresql":
        return func.to_char(func.timezone("UTC", UsageRecord.created_at), "YYYY-MM-DD")
    return func.date(UsageRecord.created_at)  # SQLite holds UTC text: its date part


def _totals() -> list[ColumnElement[Any]]:
    return [
        func.count().label("requests"),
        func.coalesce(func.sum(UsageRecord.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(UsageRecord.completion_tokens), 0).label("completion_tokens"),
        func.coalesce(func.sum(UsageRecord.cached_tokens), 0).label("cached_tokens"),
        func.sum(case((UsageRecord.status == UsageStatus.aborted.value, 1), else_=0)).label(
            "aborted"
        ),
        func.sum(case((UsageRecord.status == UsageStatus.error.value, 1), else_=0)).label("errors"),
        func.avg(UsageRecord.latency_ms).label("avg_latency_ms"),
    ]


def in_period(start: datetime, end: datetime) -> list[ColumnElement[bool]]:
    if end <= start:
        raise ValueError(f"the period ends ({end}) before it starts ({start})")
    return [UsageRecord.created_at >= start, UsageRecord.created_at < end]


def usage_summary(
    session: Session,
    *,
    start: datetime,
    end: datetime,
    group_by: GroupBy = "tenant",
    tenant_id: int | None = None,
) -> list[UsageSummary]:
    """Request and token totals per tenant, per (tenant, adapter), per (tenant, adapter,
    version) or per UTC day."""
    where = in_period(start, end)
    if tenant_id is not None:
        where.append(UsageRecord.tenant_id == tenant_id)
    if group_by == "tenant":
        keys: list[ColumnElement[Any]] = [UsageRecord.tenant_id, Tenant.name]
    elif group_by == "adapter":
        keys = [UsageRecord.tenant_id, Tenant.name, UsageRecord.adapter_name]
    elif group_by == "version":
        keys = [
            UsageRecord.tenant_id,
            Tenant.name,
            UsageRecord.adapter_name,
            UsageRecord.adapter_version,
        ]
    elif group_by == "day":
        keys = [_day(session).label("day")]
    else:
        raise ValueError(
            f"group_by must be 'tenant', 'adapter', 'version' or 'day', not {group_by!r}"
        )
    query = select(*keys, *_totals()).join(Tenant, Tenant.id == UsageRecord.tenant_id)
    # NULLS FIRST: the base model sorts before adapters on both backends.
    order = [key.nulls_first() for key in keys]
    rows = session.execute(query.where(*where).group_by(*keys).order_by(*order)).all()

    out = []
    for row in rows:
        m = row._mapping
        out.append(
            UsageSummary(
                tenant_id=m["tenant_id"] if group_by != "day" else None,
                tenant=m["name"] if group_by != "day" else None,
                adapter=m["adapter_name"] if group_by in ("adapter", "version") else None,
                version=m["adapter_version"] if group_by == "version" else None,
                day=date.fromisoformat(m["day"]) if group_by == "day" else None,
                requests=int(m["requests"]),
                prompt_tokens=int(m["prompt_tokens"]),
                completion_tokens=int(m["completion_tokens"]),
                cached_tokens=int(m["cached_tokens"]),
                aborted=int(m["aborted"]),
                errors=int(m["errors"]),
                avg_latency_ms=None if m["avg_latency_ms"] is None else float(m["avg_latency_ms"]),
            )
        )
    return out


@dataclass(frozen=True)
class BillingRow:
    tenant_id: int
    tenant: str
    period_start: datetime
    period_end: datetime
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    price_prompt_per_1k: Decimal
    price_completion_per_1k: Decimal
    prompt_cost: Decimal  # interactive prompt tokens at the tenant's price
    completion_cost: Decimal  # interactive completion tokens at the tenant's price
    # The Batch API's part of the totals above, priced at the tenant's prices times its
    # batch_price_factor.
    batch_requests: int = 0
    batch_prompt_tokens: int = 0
    batch_completion_tokens: int = 0
    batch_price_factor: Decimal = Decimal("0.5")
    batch_cost: Decimal = Decimal(0)
    cost: Decimal = Decimal(0)  # prompt_cost + completion_cost + batch_cost: the columns add up
    # In the per-version export (`by="version"`): the adapter and the version that answered
    # (both None for the base model); empty in the per-tenant one.
    adapter: str | None = None
    adapter_version: int | None = None
    # Guardrail events in the period (platform/guardrails/audit.py), per tenant: filled in the
    # per-tenant export only (an event is the tenant's, not a version's; a blocked input ran on
    # none), empty in the per-version one.
    guardrail_blocks: int | None = None
    guardrail_redactions: int | None = None
    guardrail_flags: int | None = None
    guardrail_fail_opens: int | None = None


def as_utc(moment: datetime) -> datetime:
    # Naive datetimes are UTC, as everywhere in the registry.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _cost(tokens: int, price_per_1k: Decimal) -> Decimal:
    return (Decimal(tokens) * price_per_1k / 1000).quantize(COST_QUANTUM, rounding=ROUND_HALF_UP)


@dataclass(frozen=True)
class Costs:
    prompt: Decimal  # interactive prompt tokens at the tenant's price
    completion: Decimal  # interactive completion tokens at the tenant's price
    batch: Decimal  # Batch API tokens at the tenant's prices times its batch_price_factor

    @property
    def total(self) -> Decimal:
        return self.prompt + self.completion + self.batch


def costs(
    tenant: Tenant, prompt: int, completion: int, batch_prompt: int, batch_completion: int
) -> Costs:
    """What tokens cost a tenant at its current prices; `prompt` and `completion` include the
    batch tokens, which are priced apart (the billing export's and the portal's one rule)."""
    factor = tenant.batch_price_factor
    return Costs(
        prompt=_cost(prompt - batch_prompt, tenant.price_prompt_per_1k),
        completion=_cost(completion - batch_completion, tenant.price_completion_per_1k),
        batch=_cost(batch_prompt, tenant.price_prompt_per_1k * factor)
        + _cost(batch_completion, tenant.price_completion_per_1k * factor),
    )


def billing_export(
    session: Session, *, start: datetime, end: datetime, by: BillingBy = "tenant"
) -> list[BillingRow]:
    """Per tenant with usage in [start, end) (or, `by="version"`, per tenant, adapter and
    adapter version that answered): tokens and their cost at the tenant's prices.

    Uses the prices current at export time (the registry keeps no price history). Batch API
    tokens are in the totals and, apart, in the batch columns, at the batch price.
    """
    start, end = as_utc(start), as_utc(end)
    tenants = {t.id: t for t in session.scalars(select(Tenant))}
    keys: list[Any] = [UsageRecord.tenant_id]
    if by == "version":
        keys += [UsageRecord.adapter_name, UsageRecord.adapter_version]
    batch = {
        tuple(row)[: len(keys)]: row
        for row in session.execute(
            select(*keys, *_totals()[:3])
            .where(*in_period(start, end), UsageRecord.request_class == RequestClass.batch.value)
            .group_by(*keys)
        )
    }
    rows = []
    group = "version" if by == "version" else "tenant"
    for s in usage_summary(session, start=start, end=end, group_by=group):
        assert s.tenant_id is not None and s.tenant is not None
        tenant = tenants[s.tenant_id]
        key = (s.tenant_id, s.adapter, s.version) if by == "version" else (s.tenant_id,)
        b = batch.get(key)
        b_requests, b_prompt, b_completion = (
            (int(b.requests), int(b.prompt_tokens), int(b.completion_tokens)) if b else (0, 0, 0)
        )
        c = costs(tenant, s.prompt_tokens, s.completion_tokens, b_prompt, b_completion)
        rows.append(
            BillingRow(
                tenant_id=s.tenant_id,
                tenant=s.tenant,
                period_start=start,
                period_end=end,
                requests=s.requests,
                prompt_tokens=s.prompt_tokens,
                completion_tokens=s.completion_tokens,
                cached_tokens=s.cached_tokens,
                price_prompt_per_1k=tenant.price_prompt_per_1k,
                price_completion_per_1k=tenant.price_completion_per_1k,
                prompt_cost=c.prompt,
                completion_cost=c.completion,
                batch_requests=b_requests,
                batch_prompt_tokens=b_prompt,
                batch_completion_tokens=b_completion,
                batch_price_factor=tenant.batch_price_factor,
                batch_cost=c.batch,
                cost=c.total,
                adapter=s.adapter if by == "version" else None,
                adapter_version=s.version if by == "version" else None,
            )
        )
    return rows if by == "version" else _with_guardrail_counts(session, rows, start, end, tenants)


def _with_guardrail_counts(
    session: Session,
    rows: list[BillingRow],
    start: datetime,
    end: datetime,
    tenants: dict[int, Tenant],
) -> list[BillingRow]:
    found = guardrail_counts(session, start=start, end=end)
    # A tenant whose every request was blocked has events but no usage: a zero-token row, so
    # its blocks still appear on the bill.
    zero = dict.fromkeys(("requests", "prompt_tokens", "completion_tokens", "cached_tokens"), 0)
    rows += [
        BillingRow(
            tenant_id=t,
            tenant=tenants[t].name,
            period_start=start,
            period_end=end,
            price_prompt_per_1k=tenants[t].price_prompt_per_1k,
            price_completion_per_1k=tenants[t].price_completion_per_1k,
            prompt_cost=Decimal(0),
            completion_cost=Decimal(0),
            batch_price_factor=tenants[t].batch_price_factor,
            **zero,
        )
        for t in sorted(found.keys() - {r.tenant_id for r in rows})
    ]
    return [
        dataclasses.replace(
            r,
            guardrail_blocks=found.get(r.tenant_id, {}).get("block", 0),
            guardrail_redactions=found.get(r.tenant_id, {}).get("redact", 0),
            guardrail_flags=found.get(r.tenant_id, {}).get("flag", 0),
            guardrail_fail_opens=found.get(r.tenant_id, {}).get("fail_open", 0),
        )
        for r in rows
    ]


def _plain(value: Any) -> Any:
    # Decimals as strings: exact in JSON and CSV, unlike floats.
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, datetime | date):
        return value.isoformat()
    return value


def _dicts(rows: Sequence[Any]) -> list[dict[str, Any]]:
    return [{k: _plain(v) for k, v in dataclasses.asdict(row).items()} for row in rows]


def to_csv(rows: Sequence[Any], *, row_type: type = BillingRow) -> str:
    """CSV with a header row, of `BillingRow`s or `UsageSummary`s (or any dataclasses).

    `row_type` only names the columns of an empty export.
    """
    fields = dataclasses.fields(rows[0] if rows else row_type)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[f.name for f in fields], lineterminator="\n")
    writer.writeheader()
    writer.writerows(_dicts(rows))
    return buffer.getvalue()


def to_json(rows: Sequence[Any]) -> str:
    return json.dumps(_dicts(rows), indent=2)


@dataclass(frozen=True)
class TenantUsageRow:
    """One tenant's usage of one adapter on one UTC day, and its cost at the tenant's prices."""

    day: date
    adapter: str | None  # None: the base model
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    errors: int
    prompt_cost: Decimal
    completion_cost: Decimal
    cost: Decimal


def tenant_usage(
    session: Session, *, tenant_id: int, start: datetime, end: datetime
) -> list[TenantUsageRow]:
    """The tenant's usage in [start, end) per UTC day and adapter, oldest day first, with costs
    at its current prices (each row rounded on its own, so a month's rows may add up to a
    cent's fraction more or less than its billing export, which rounds the month once)."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise ValueError(f"no tenant with id {tenant_id}")
    day = _day(session).label("day")
    keys: list[ColumnElement[Any]] = [day, UsageRecord.adapter_name]
    query = (
        select(*keys, *_totals())
        .where(*in_period(as_utc(start), as_utc(end)), UsageRecord.tenant_id == tenant_id)
        .group_by(*keys)
        .order_by(day, UsageRecord.adapter_name.nulls_first())
    )
    rows = []
    for row in session.execute(query).all():
        m = row._mapping
        prompt_cost = _cost(int(m["prompt_tokens"]), tenant.price_prompt_per_1k)
        completion_cost = _cost(int(m["completion_tokens"]), tenant.price_completion_per_1k)
        rows.append(
            TenantUsageRow(
                day=date.fromisoformat(m["day"]),
                adapter=m["adapter_name"],
                requests=int(m["requests"]),
                prompt_tokens=int(m["prompt_tokens"]),
                completion_tokens=int(m["completion_tokens"]),
                cached_tokens=int(m["cached_tokens"]),
                errors=int(m["errors"]),
                prompt_cost=prompt_cost,
                completion_cost=completion_cost,
                cost=prompt_cost + completion_cost,
            )
        )
    return rows


# A refused request (429) leaves no ledger row (the ledger bills), so the overview counts
# refusals here: per tenant, on this replica, since it started (the newest 10,000 a tenant).
_refusals: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=10_000))


def count_refusal(tenant_id: int, *, now: float | None = None) -> None:
    _refusals[tenant_id].append(time.time() if now is None else now)


def refusals_since(since: datetime) -> dict[int, int]:
    """Quota refusals per tenant on this replica from `since` on."""
    cutoff = as_utc(since).timestamp()
    counts = {
        t: sum(1 for at in list(times) if at >= cutoff) for t, times in list(_refusals.items())
    }
    return {t: n for t, n in counts.items() if n}


def adapter_names(
    session: Session, *, start: datetime, end: datetime, tenant_id: int | None = None
) -> list[str]:
    """The adapter names in the ledger in [start, end) (deleted adapters included), sorted."""
    where = [*in_period(as_utc(start), as_utc(end)), UsageRecord.adapter_name.is_not(None)]
    if tenant_id is not None:
        where.append(UsageRecord.tenant_id == tenant_id)
    query = select(UsageRecord.adapter_name).where(*where).distinct()
    return sorted(name for name in session.scalars(query) if name is not None)
