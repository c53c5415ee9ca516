"""What the tenant portal (platform/api/routes/portal.py) reads and changes, always for one
tenant: the caller of a portal session, a sign-in, the account's quotas and what is left of
them, the tenant's own keys, its usage priced with the Batch API part apart, its latency.

The routes hold no query of their own; every function here is scoped to the tenant it is
given, so another tenant's key is not found exactly like one that does not exist.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal

from sqlalchemy import select

from loraplex.platform import quotas, usage
from loraplex.platform.db import crud
from loraplex.platform.db.models import (
    ApiKey,
    RateCounter,
    RequestClass,
    Tenant,
    TenantStatus,
    UsageRecord,
    utcnow,
)
from loraplex.platform.db.schemas import ApiKeyCreated, ApiKeyPublic
from loraplex.platform.errors import APIError
from loraplex.platform.latency_stats import LatencyStats, latency_stats
from loraplex.platform.state import AppState, Caller

MAX_KEYS_PER_TENANT = 50  # live keys a tenant may hold: a runaway script cannot mint without end

# The quotas the account shows, each with how much of it is used now.
LIMITS = (
    "requests_per_min",
    "tokens_per_min",
    "tokens_per_month",
    "max_adapters",
    "max_adapter_bytes",
    "max_rank",
    "batch_tokens_per_month",
)


# ---------------------------------------------------------------------------------- session
def session_caller(state: AppState, tenant_id: int, key_id: int) -> Caller:
    """The tenant and key a portal session was signed in with, if the key still works; else
    401 (revoked, expired, its tenant suspended)."""
    with state.sessions() as session:
        row = session.execute(
            select(ApiKey, Tenant)
            .join(Tenant)
            .where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id)
        ).first()
        now = utcnow()
        if (
            row is None
            or row[0].revoked_at is not None
            or (row[0].expires_at is not None and row[0].expires_at <= now)
            or row[1].status != TenantStatus.active
        ):
            raise APIError(
                401,
                "the portal session ended: the key it was signed in with no longer works; "
                "sign in again with a working key",
                "no_session",
            )
        session.expunge_all()
    return Caller(tenant=row[1], key=row[0])


def sign_in(state: AppState, api_key: str) -> tuple[int, int] | None:
    """(tenant id, key id) of a working tenant API key; None for an unknown, revoked or
    expired key or a suspended tenant alike."""
    with state.sessions() as session:
        found = crud.authenticate(session, api_key) if api_key else None
        return None if found is None else (found[0].id, found[1].id)


# ---------------------------------------------------------------------------------- account
@dataclass(frozen=True)
class Account:
    limits: dict[str, int | None]  # LIMITS -> the quota, None for unlimited
    used: dict[str, int]  # the limits with a usage -> how much of it is used now
    month_resets_at: datetime


def account(state: AppState, caller: Caller) -> Account:
    """The tenant's quotas and how much of each it has used now."""
    tenant_id = caller.tenant.id
    now = utcnow()
    with state.sessions() as session:
        quota = crud.get_quota(session, tenant_id=tenant_id)
        month_tokens = quotas.monthly_tokens(session, tenant_id, now=now)
        batch_tokens = quotas.monthly_tokens(
            session, tenant_id, now=now, request_class=RequestClass.batch
        )
        counter = session.get(RateCounter, (tenant_id, quotas.minute_start(now)))
        minute_requests, minute_tokens = (counter.requests, counter.tokens) if counter else (0, 0)
        totals = crud.adapter_totals(session, tenant_id=tenant_id)
    used = {
        "requests_per_min": minute_requests,
        "tokens_per_min": minute_tokens,  # reserved for requests running, corrected at their end
        "tokens_per_month": month_tokens,
        "max_adapters": totals.count,
        "max_adapter_bytes": totals.bytes,
        "batch_tokens_per_month": batch_tokens,
    }
    limits = {name: getattr(quota, name) if quota else None for name in LIMITS}
    return Account(limits=limits, used=used, month_resets_at=quotas.next_month_start(now))


# ---------------------------------------------------------------------------------- keys
def list_keys(state: AppState, caller: Caller) -> list[ApiKeyPublic]:
    with state.sessions() as session:
        return crud.list_keys(session, tenant_id=caller.tenant.id)


def create_key(
    state: AppState, caller: Caller, *, name: str, expires_at: datetime | None
) -> ApiKeyCreated:
    """A new key of the tenant's (400 past MAX_KEYS_PER_TENANT working keys, or already
    expired); its secret is in the answer only."""
    if expires_at is not None:
        expires_at = expires_at.replace(tzinfo=UTC) if expires_at.tzinfo is None else expires_at
        if expires_at <= utcnow():
            raise APIError(
                400, "expires_at is in the past: the key would never work", "invalid_value"
            )
    with state.sessions() as session:
        live = [k for k in crud.list_keys(session, tenant_id=caller.tenant.id) if not k.revoked_at]
        if len(live) >= MAX_KEYS_PER_TENANT:
            raise APIError(
                400,
                f"this account has {len(live)} working keys, the most it may hold; "
                "revoke one first",
                "too_many_keys",
            )
        secret, key = crud.create_key(
            session, tenant_id=caller.tenant.id, name=name, expires_at=expires_at
        )
        public = ApiKeyPublic.model_validate(key)
    return ApiKeyCreated(**public.model_dump(), secret=secret)


def revoke_key(state: AppState, caller: Caller, key_id: int) -> ApiKeyPublic:
    """Revoke one of the tenant's keys (idempotent); another tenant's key is a 404."""
    with state.sessions() as session:
        try:
            key = crud.revoke_key(session, key_id=key_id, tenant_id=caller.tenant.id)
        except crud.NotFound:
            raise APIError(404, f"no API key with id {key_id}", "key_not_found") from None
        return ApiKeyPublic.model_validate(key)


# ---------------------------------------------------------------------------------- usage
@dataclass(frozen=True)
class PortalUsageRow(usage.TenantUsageRow):
    """A day and adapter of the tenant's usage. Its Batch API part (in the totals too) is
    priced at the tenant's prices times its batch_price_factor, as the billing export prices
    it: `prompt_cost` and `completion_cost` are the interactive part's, `cost` all of it."""

    batch_requests: int = 0
    batch_prompt_tokens: int = 0
    batch_completion_tokens: int = 0
    batch_cost: Decimal = Decimal(0)


def _batch_usage(
    session, tenant_id: int, start: datetime, end: datetime
) -> dict[tuple[date, str | None], tuple[int, int, int]]:
    """(day, adapter) -> (requests, prompt tokens, completion tokens) of the tenant's Batch API
    lines in [start, end), grouped as `usage.tenant_usage` groups."""
    day = usage._day(session).label("day")
    query = (
        select(day, UsageRecord.adapter_name, *usage._totals()[:3])
        .where(
            *usage.in_period(start, end),
            UsageRecord.tenant_id == tenant_id,
            UsageRecord.request_class == RequestClass.batch.value,
        )
        .group_by(day, UsageRecord.adapter_name)
    )
    return {
        (date.fromisoformat(d), adapter): (int(n), int(p), int(c))
        for d, adapter, n, p, c in session.execute(query)
    }


def tenant_usage(session, tenant: Tenant, start: datetime, end: datetime) -> list[PortalUsageRow]:
    """`usage.tenant_usage` with each row's batch part apart and at the batch price."""
    start, end = usage.as_utc(start), usage.as_utc(end)
    batch = _batch_usage(session, tenant.id, start, end)
    rows = []
    for r in usage.tenant_usage(session, tenant_id=tenant.id, start=start, end=end):
        b_requests, b_prompt, b_completion = batch.get((r.day, r.adapter), (0, 0, 0))
        c = usage.costs(tenant, r.prompt_tokens, r.completion_tokens, b_prompt, b_completion)
        rows.append(
            PortalUsageRow(
                **{
                    **dataclasses.asdict(r),
                    "prompt_cost": c.prompt,
                    "completion_cost": c.completion,
                    "cost": c.total,
                },
                batch_requests=b_requests,
                batch_prompt_tokens=b_prompt,
                batch_completion_tokens=b_completion,
                batch_cost=c.batch,
            )
        )
    return rows


def usage_report(
    state: AppState, caller: Caller, start: datetime, end: datetime
) -> tuple[Decimal, list[PortalUsageRow]]:
    """The tenant's batch price factor (as stored now) and its usage rows in [start, end)."""
    with state.sessions() as session:
        tenant = session.get(Tenant, caller.tenant.id)
        return tenant.batch_price_factor, tenant_usage(session, tenant, start, end)


def latency(state: AppState, caller: Caller, start: datetime, end: datetime) -> list[LatencyStats]:
    """`latency_stats` of the tenant's requests in [start, end), per adapter."""
    with state.sessions() as session:
        return latency_stats(
            session, start=start, end=end, by="adapter", tenant_id=caller.tenant.id
        )
