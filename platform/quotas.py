"""Per-tenant rate limits and budgets, enforced through the database so replicas share them.

Per-minute limits use one `RateCounter` row per tenant and wall-clock minute. A request is
charged with a single conditional UPSERT (`INSERT ... ON CONFLICT DO UPDATE ... WHERE
<still under the limits>`), which both SQLite and PostgreSQL run atomically: concurrent
requests on any number of replicas can never push a counter past its limit, and a request
that is refused charges nothing.

The monthly budget is an approximation: it compares the usage ledger of the calendar month
(UTC) plus this request's estimate against the limit. Requests still in flight elsewhere are
not in the ledger yet, so a burst can overshoot the budget by at most the tokens in flight at
once (bounded by `tokens_per_min` when that is set). This keeps the check a read, not a write
shared by every request of the tenant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import and_, case, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loraplex.platform.db.crud import adapter_totals
from loraplex.platform.db.models import Quota, RateCounter, RequestClass, UsageRecord

# Counters older than this are deleted once a minute per tenant; only the current one counts.
COUNTER_RETENTION = timedelta(hours=1)


@dataclass(frozen=True)
class QuotaDecision:
    allowed: bool
    # Seconds until the exceeded limit resets (for `Retry-After`); None when waiting cannot
    # help because the request alone is larger than the limit.
    retry_after_s: int | None = None
    reason: str | None = None  # for the 429 body
    limit: str | None = None  # the Quota field that refused, e.g. "tokens_per_min"


ALLOWED = QuotaDecision(allowed=True)


def _utc(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    return now.replace(tzinfo=UTC) if now.tzinfo is None else now.astimezone(UTC)


def minute_start(now: datetime) -> datetime:
    return _utc(now).replace(second=0, microsecond=0)


def month_start(now: datetime) -> datetime:
    return _utc(now).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def next_month_start(now: datetime) -> datetime:
    start = month_start(now)
    return (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )


def _seconds_until(then: datetime, now: datetime) -> int:
    return max(1, math.ceil((then - now).total_seconds()))


def monthly_tokens(
    session: Session,
    tenant_id: int,
    *,
    now: datetime | None = None,
    request_class: RequestClass | None = None,
) -> int:
    """Prompt + completion tokens in the ledger for the calendar month (UTC) of `now` (of one
    request class only, if given)."""
    total = func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens)
    where = [UsageRecord.tenant_id == tenant_id, UsageRecord.created_at >= month_start(_utc(now))]
    if request_class is not None:
        where.append(UsageRecord.request_class == RequestClass(request_class).value)
    used = session.scalar(select(func.coalesce(total, 0)).where(*where))
    return int(used or 0)


def check_batch_budget(
    session: Session, tenant_id: int, *, tokens: int = 0, now: datetime | None = None
) -> QuotaDecision:
    """The tenant's own monthly budget for Batch API tokens (`batch_tokens_per_month`), which
    batch lines meet besides every other limit. Charges nothing: like `tokens_per_month`, a
    read of the ledger (lines running elsewhere may overshoot it by what they are sent)."""
    now = _utc(now)
    decision = _batch_budget(
        session, session.get(Quota, tenant_id, populate_existing=True), tokens, now
    )
    session.commit()  # end the read
    return decision


def _batch_budget(session: Session, quota: Quota | None, tokens: int, now: datetime):
    budget = quota.batch_tokens_per_month if quota is not None else None
    if budget is None:
        return ALLOWED
    used = monthly_tokens(session, quota.tenant_id, now=now, request_class=RequestClass.batch)
    if used < budget and used + tokens <= budget:
        return ALLOWED
    wait = None if tokens > budget else _seconds_until(next_month_start(now), now)
    return QuotaDecision(
        allowed=False,
        retry_after_s=wait,
        reason=f"monthly Batch API token budget exceeded: {used} of {budget} tokens used "
        f"this month" + (f", this request may need {tokens}" if tokens else ""),
        limit="batch_tokens_per_month",
    )


def _upsert(session: Session):  # the dialect's INSERT with ON CONFLICT support
    return (postgresql if session.get_bind().dialect.name == "postgresql" else sqlite).insert


def check_and_charge(
    session: Session,
    tenant_id: int,
    *,
    requests: int = 1,
    tokens: int,
    now: datetime | None = None,
    request_class: RequestClass = RequestClass.interactive,
) -> QuotaDecision:
    """Admit a request estimated at `tokens` (prompt + max completion) or say why not.

    Charges the current minute's counter when admitted (commits); a refusal charges nothing.
    Correct the estimate with `adjust_tokens` when the request ends. A Batch API line meets
    its class's own monthly budget too.
    """
    now = _utc(now)
    quota = session.get(Quota, tenant_id, populate_existing=True)
    if quota is None:
        return ALLOWED
    if RequestClass(request_class) is RequestClass.batch:
        decision = _batch_budget(session, quota, tokens, now)
        if not decision.allowed:
            return decision

    if (budget := quota.tokens_per_month) is not None:
        used = monthly_tokens(session, tenant_id, now=now)
        if used + tokens > budget:
            # Waiting for next month cannot help a request bigger than the whole budget.
            wait = None if tokens > budget else _seconds_until(next_month_start(now), now)
            return QuotaDecision(
                allowed=False,
                retry_after_s=wait,
                reason=f"monthly token budget exceeded: {used} of {budget} tokens used this "
                f"month, this request may need {tokens}",
                limit="tokens_per_month",
            )

    rpm, tpm = quota.requests_per_min, quota.tokens_per_min
    if rpm is None and tpm is None:
        return ALLOWED
    if rpm is not None and requests > rpm:
        reason = f"this tenant's limit is {rpm} requests per minute"
        return QuotaDecision(allowed=False, reason=reason, limit="requests_per_min")
    if tpm is not None and tokens > tpm:
        reason = (
            f"this request may need {tokens} tokens but the limit is {tpm} tokens per minute: "
            "lower max_tokens or shorten the prompt"
        )
        return QuotaDecision(allowed=False, reason=reason, limit="tokens_per_min")

    window = minute_start(now)
    insert = _upsert(session)(RateCounter).values(
        tenant_id=tenant_id, window_start=window, requests=requests, tokens=tokens
    )
    still_under = []
    if rpm is not None:
        still_under.append(RateCounter.requests + requests <= rpm)
    if tpm is not None:
        still_under.append(RateCounter.tokens + tokens <= tpm)
    upsert = insert.on_conflict_do_update(
        index_elements=[RateCounter.tenant_id, RateCounter.window_start],
        set_={
            "requests": RateCounter.requests + insert.excluded.requests,
            "tokens": RateCounter.tokens + insert.excluded.tokens,
        },
        where=and_(*still_under),
    ).returning(RateCounter.requests)
    charged = session.execute(upsert).scalar_one_or_none()
    if charged == requests:  # the first request of this minute: drop stale counters
        session.execute(
            delete(RateCounter).where(
                RateCounter.tenant_id == tenant_id,
                RateCounter.window_start < window - COUNTER_RETENTION,
            )
        )
    session.commit()
    if charged is not None:
        return ALLOWED

    current = session.execute(
        select(RateCounter.requests, RateCounter.tokens).where(
            RateCounter.tenant_id == tenant_id, RateCounter.window_start == window
        )
    ).one_or_none()
    session.commit()  # end the read so the row is not held
    used_requests, used_tokens = current or (0, 0)
    retry_after = _seconds_until(window + timedelta(minutes=1), now)
    if rpm is not None and used_requests + requests > rpm:
        return QuotaDecision(
            allowed=False,
            retry_after_s=retry_after,
            reason=f"rate limit: {rpm} requests per minute",
            limit="requests_per_min",
        )
    return QuotaDecision(
        allowed=False,
        retry_after_s=retry_after,
        reason=f"rate limit: {tpm} tokens per minute ({used_tokens} used this minute, this "
        f"request may need {tokens})",
        limit="tokens_per_min",
    )


def adjust_tokens(
    session: Session,
    tenant_id: int,
    delta: int,
    *,
    now: datetime | None = None,
    commit: bool = True,
) -> None:
    """Correct a charge by `delta` tokens (actual - estimated) when a request ends.

    Corrects the counter of the minute containing `now`; pass the time the request was
    charged to give an over-estimate back to that minute. Never goes below zero. Commits,
    unless `commit` is false.
    """
    if delta == 0:
        return
    quota = session.get(Quota, tenant_id, populate_existing=True)
    if quota is None or quota.tokens_per_min is None:
        return  # nothing reads the token counters of this tenant
    insert = _upsert(session)(RateCounter).values(
        tenant_id=tenant_id, window_start=minute_start(_utc(now)), requests=0, tokens=max(delta, 0)
    )
    corrected = RateCounter.tokens + delta
    session.execute(
        insert.on_conflict_do_update(
            index_elements=[RateCounter.tenant_id, RateCounter.window_start],
            set_={"tokens": case((corrected < 0, 0), else_=corrected)},
        )
    )
    if commit:
        session.commit()


def check_adapter_quota(
    session: Session, tenant_id: int, *, rank: int, bytes: int, new_name: bool = True
) -> QuotaDecision:
    """May the tenant store one more adapter (or, with `new_name` false, one more version of
    an adapter it has) of this rank and size? (For uploads.) Versions count towards the
    bytes, not the number of adapters.

    Two uploads racing past the check can exceed `max_adapters` by one each; uploads are rare
    and the registry stays consistent, so this is not worth a lock.
    """
    quota = session.get(Quota, tenant_id, populate_existing=True)
    if quota is None:
        return ALLOWED
    if quota.max_rank is not None and rank > quota.max_rank:
        reason = f"adapter rank {rank} exceeds this tenant's max rank {quota.max_rank}"
        return QuotaDecision(allowed=False, reason=reason, limit="max_rank")
    count, total = adapter_totals(session, tenant_id=tenant_id)
    if quota.max_adapters is not None and new_name and count + 1 > quota.max_adapters:
        reason = f"this tenant already has {count} of {quota.max_adapters} adapters: delete one"
        return QuotaDecision(allowed=False, reason=reason, limit="max_adapters")
    if quota.max_adapter_bytes is not None and total + bytes > quota.max_adapter_bytes:
        reason = (
            f"storing {bytes} more bytes would exceed this tenant's {quota.max_adapter_bytes} "
            f"bytes of adapters ({total} used)"
        )
        return QuotaDecision(allowed=False, reason=reason, limit="max_adapter_bytes")
    return ALLOWED
