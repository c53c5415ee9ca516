"""The tenant portal at /portal: a tenant's own adapters, keys, usage, costs and quotas.

A tenant signs in with one of its API keys, swapped for a signed cookie scoped to /portal
(`admin_session`: HttpOnly, SameSite=Strict, a CSRF header on every state-changing call). The
pages are the dashboard's kind (files in `admin_ui/`, the same CSP, no inline code, nothing
from other sites) and call `/portal/api/...`, which answers for the signed-in tenant only:
every query is scoped to the session's tenant, and another tenant's adapter or key is a 404
exactly like one that does not exist.

Adapters go through the very handlers of `/v1/adapters` (same validation, limits, errors).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Annotated, Literal

from fastapi import APIRouter, Body, Depends, FastAPI, Form, Query, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy import select

from loraplex.platform import quotas, usage
from loraplex.platform.admin_session import (
    PORTAL_COOKIE,
    check_portal_request,
    clear_portal_cookie,
    new_portal_session,
    portal_csrf_token,
    portal_session,
    set_portal_cookie,
)
from loraplex.platform.api.deps import StateDep
from loraplex.platform.api.errors import API_ERRORS, APIError
from loraplex.platform.api.routes import adapters as tenant_adapters
from loraplex.platform.api.routes.admin import KeyIn
from loraplex.platform.api.routes.admin_ui import _HEADERS, UI_DIR
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
from loraplex.platform.periods import last_day, period
from loraplex.platform.state import AppState, Caller

MAX_KEYS_PER_TENANT = 50  # live keys a tenant may hold: a runaway script cannot mint without end

pages = APIRouter(prefix="/portal", tags=["tenant portal"], include_in_schema=False)


def _page(name: str) -> Response:
    return FileResponse(UI_DIR / name, media_type="text/html", headers=_HEADERS)


def _session_caller(request: Request, state: AppState) -> Caller:
    """The tenant and key of the portal session, if the key still works; else 401."""
    tenant_id, key_id = check_portal_request(request, state.admin_key)
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


def portal_caller(request: Request, state: StateDep) -> Caller:
    return _session_caller(request, state)


PortalCaller = Annotated[Caller, Depends(portal_caller)]
# The pages' own backend, not a public API (tenants script against /v1): kept out of the schema.
api = APIRouter(
    prefix="/portal/api", tags=["tenant portal"], responses=API_ERRORS, include_in_schema=False
)


# ---------------------------------------------------------------------------------- pages
def _signed_in(request: Request, state: AppState) -> bool:
    """A valid session whose key still works (a revoked key's session must land on the
    sign-in form, not bounce between it and the portal)."""
    if portal_session(state.admin_key, request.cookies.get(PORTAL_COOKIE, "")) is None:
        return False
    try:
        _session_caller(request, state)
    except APIError:
        return False
    return True


@pages.get("")
def portal(request: Request, state: StateDep) -> Response:
    if not _signed_in(request, state):
        return RedirectResponse("/portal/login", status_code=303)
    return _page("portal.html")


@pages.get("/login")
def login_page(request: Request, state: StateDep) -> Response:
    if _signed_in(request, state):
        return RedirectResponse("/portal", status_code=303)
    return _page("portal-login.html")


@pages.post("/login")
def login(
    request: Request, state: StateDep, api_key: Annotated[str, Form(max_length=4096)] = ""
) -> Response:
    """Check a tenant API key once and swap it for a portal session cookie."""
    with state.sessions() as session:
        found = crud.authenticate(session, api_key.strip()) if api_key else None
        if found is None:  # unknown, revoked, expired, suspended: one answer for all
            return RedirectResponse("/portal/login?error=1", status_code=303)
        tenant, key = found
        value, _ = new_portal_session(state.admin_key, tenant.id, key.id)
    response = RedirectResponse("/portal", status_code=303)
    set_portal_cookie(response, request, value)
    return response


@pages.post("/logout", status_code=204)
def logout(request: Request, state: StateDep) -> Response:
    check_portal_request(request, state.admin_key)  # CSRF: no other site may sign us out
    response = Response(status_code=204)
    clear_portal_cookie(response)
    return response


@pages.get("/session")
def session_info(request: Request, state: StateDep, caller: PortalCaller) -> dict:
    """The CSRF token of this session, when it expires, and who is signed in."""
    value = request.cookies[PORTAL_COOKIE]
    found = portal_session(state.admin_key, value)
    assert found is not None  # checked by `portal_caller`
    return {
        "csrf_token": portal_csrf_token(state.admin_key, value),
        "expires_at": found[2],
        "tenant": caller.tenant.name,
        "key_prefix": caller.key.prefix,
    }


# ---------------------------------------------------------------------------------- account
def _left(limit: int | None, used: int) -> int | None:
    return None if limit is None else max(0, limit - used)


@api.get("/account")
def account(state: StateDep, caller: PortalCaller) -> dict:
    """The tenant, its prices, its quotas and how much of each is left now."""
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
    limits = {
        "requests_per_min": quota.requests_per_min if quota else None,
        "tokens_per_min": quota.tokens_per_min if quota else None,
        "tokens_per_month": quota.tokens_per_month if quota else None,
        "max_adapters": quota.max_adapters if quota else None,
        "max_adapter_bytes": quota.max_adapter_bytes if quota else None,
        "max_rank": quota.max_rank if quota else None,
        "batch_tokens_per_month": quota.batch_tokens_per_month if quota else None,
    }
    used = {
        "requests_per_min": minute_requests,
        "tokens_per_min": minute_tokens,  # reserved for requests running, corrected at their end
        "tokens_per_month": month_tokens,
        "max_adapters": totals.count,
        "max_adapter_bytes": totals.bytes,
        "batch_tokens_per_month": batch_tokens,
    }
    t = caller.tenant
    return {
        "tenant": {
            "id": t.id,
            "name": t.name,
            "price_prompt_per_1k": format(t.price_prompt_per_1k, "f"),
            "price_completion_per_1k": format(t.price_completion_per_1k, "f"),
            "batch_price_factor": format(t.batch_price_factor, "f"),
        },
        "key": {"id": caller.key.id, "name": caller.key.name, "prefix": caller.key.prefix},
        "limits": limits,
        "used": used,
        "left": {k: _left(limits[k], v) for k, v in used.items()},
        "month_resets_at": quotas.next_month_start(now).isoformat(),
    }


# ---------------------------------------------------------------------------------- adapters
@api.get("/adapters")
def list_adapters(state: StateDep, caller: PortalCaller):
    return tenant_adapters.list_adapters(state, caller)


@api.get("/adapters/{name}")
def get_adapter(name: str, state: StateDep, caller: PortalCaller):
    return tenant_adapters.get_adapter(name, state, caller)


@api.post("/adapters", status_code=201)
async def upload_adapter(request: Request, state: StateDep, caller: PortalCaller):
    """POST /v1/adapters itself: the same form, checks, limits and errors."""
    return await tenant_adapters.upload_adapter(request, state, caller)


@api.delete("/adapters/{name}")
def delete_adapter(name: str, state: StateDep, caller: PortalCaller):
    return tenant_adapters.delete_adapter(name, state, caller)


# Versions and aliases: the /v1/adapters handlers themselves (the same checks and errors).
@api.put("/adapters/{name}/aliases/{alias}")
def set_alias(name: str, alias: str, body: tenant_adapters.AliasIn, state: StateDep,
              caller: PortalCaller):  # fmt: skip
    return tenant_adapters.set_alias(name, alias, body, state, caller)


@api.post("/adapters/{name}/aliases/{alias}/rollback")
def rollback_alias(name: str, alias: str, state: StateDep, caller: PortalCaller):
    return tenant_adapters.rollback_alias(name, alias, state, caller)


@api.delete("/adapters/{name}/versions/{version}")
def delete_version(name: str, version: str, state: StateDep, caller: PortalCaller):
    return tenant_adapters.delete_version(name, version, state, caller)


# ---------------------------------------------------------------------------------- keys
@api.get("/keys")
def list_keys(state: StateDep, caller: PortalCaller) -> dict:
    with state.sessions() as session:
        keys = crud.list_keys(session, tenant_id=caller.tenant.id)
    return {
        "object": "list",
        "data": [k.model_dump(mode="json") | {"current": k.id == caller.key.id} for k in keys],
    }


@api.post("/keys", status_code=201)
def create_key(
    state: StateDep,
    caller: PortalCaller,
    response: Response,
    body: Annotated[KeyIn | None, Body()] = None,
) -> ApiKeyCreated:
    """A new key of the tenant's; `secret` is in this response only."""
    body = body or KeyIn()
    expires_at = body.expires_at
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
            session, tenant_id=caller.tenant.id, name=body.name, expires_at=expires_at
        )
        public = ApiKeyPublic.model_validate(key)
    response.headers["Cache-Control"] = "no-store"  # no proxy or browser may keep the secret
    return ApiKeyCreated(**public.model_dump(), secret=secret)


@api.post("/keys/{key_id}/revoke")
def revoke_key(key_id: int, state: StateDep, caller: PortalCaller) -> ApiKeyPublic:
    """Revoke one of the tenant's keys (idempotent); another tenant's key is not found.
    Revoking the key this session signed in with ends the session."""
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
            *usage._in_period(start, end),
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
    start, end = usage._as_utc(start), usage._as_utc(end)
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


@api.get(
    "/usage",
    response_model=None,
    responses={200: {"content": {"text/csv": {}}, "description": "JSON, or CSV with format=csv"}},
)
def usage_report(
    state: StateDep,
    caller: PortalCaller,
    start: str | None = None,
    end: str | None = None,
    fmt: Annotated[Literal["json", "csv"], Query(alias="format")] = "json",
) -> Response:
    """The tenant's requests, tokens and costs per UTC day and adapter, in [start, end]
    (ISO dates; the current month by default)."""
    try:
        lo, hi = period(start, end)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_period") from None
    with state.sessions() as session:
        tenant = session.get(Tenant, caller.tenant.id)
        rows = tenant_usage(session, tenant, lo, hi)
    if fmt == "csv":
        filename = f"loraplex-usage-{caller.tenant.name}-{lo.date()}_{last_day(hi)}.csv"
        return Response(
            usage.to_csv(rows, row_type=PortalUsageRow),
            media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )
    total = sum((r.cost for r in rows), Decimal(0))
    return JSONResponse(
        {
            "object": "list",
            "period_start": lo.isoformat(),
            "period_end": hi.isoformat(),
            "batch_price_factor": format(tenant.batch_price_factor, "f"),
            "total_cost": format(total, "f"),
            "data": json.loads(usage.to_json(rows)),
        }
    )


@api.get("/latency")
def latency(
    state: StateDep, caller: PortalCaller, start: str | None = None, end: str | None = None
) -> dict:
    """p50/p99 time to first token and per output token of the tenant's requests in
    [start, end] (the current month by default), per adapter (the base model as null)."""
    try:
        lo, hi = period(start, end)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_period") from None
    with state.sessions() as session:
        rows = usage.latency_stats(
            session, start=lo, end=hi, by="adapter", tenant_id=caller.tenant.id
        )
    return {
        "object": "list",
        "period_start": lo.isoformat(),
        "period_end": hi.isoformat(),
        "data": [
            {
                "adapter": r.key,
                "requests": r.requests,
                "errors": r.errors,
                "ttft_p50_ms": r.ttft_p50,
                "ttft_p99_ms": r.ttft_p99,
                "tpot_p50_ms": r.tpot_p50,
                "tpot_p99_ms": r.tpot_p99,
            }
            for r in rows
        ],
    }


def mount(app: FastAPI) -> None:
    """Add the portal's pages, its API and its static files (the dashboard's) to `app`."""
    app.include_router(pages)
    app.include_router(api)
    app.mount("/portal/static", StaticFiles(directory=UI_DIR / "static"), name="portal-static")
