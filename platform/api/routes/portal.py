"""The tenant portal at /portal: a tenant's own adapters, keys, usage, costs and quotas.

A tenant signs in with one of its API keys, swapped for a signed cookie scoped to /portal
(`admin_session`: HttpOnly, SameSite=Strict, a CSRF header on every state-changing call). The
pages are the dashboard's kind (files in `admin_ui/`, the same CSP, no inline code, nothing
from other sites) and call `/portal/api/...`, which answers for the signed-in tenant only:
every query is scoped to the session's tenant (`loraplex.platform.portal_service` does the
reading and changing), and another tenant's adapter or key is a 404 exactly like one that
does not exist.

Adapters go through the very handlers of `/v1/adapters` (same validation, limits, errors).
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Annotated, Literal

from fastapi import APIRouter, Body, Depends, FastAPI, Form, Query, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from loraplex.platform import portal_service as service
from loraplex.platform import usage
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
from loraplex.platform.api.routes.admin import KeyIn, ListOf
from loraplex.platform.api.routes.admin_ui import _HEADERS, UI_DIR
from loraplex.platform.db.schemas import ApiKeyCreated, ApiKeyPublic
from loraplex.platform.guardrails import routes as guardrail_routes
from loraplex.platform.periods import last_day, period
from loraplex.platform.state import AppState, Caller

pages = APIRouter(prefix="/portal", tags=["tenant portal"], include_in_schema=False)


def _page(name: str) -> Response:
    return FileResponse(UI_DIR / name, media_type="text/html", headers=_HEADERS)


def _session_caller(request: Request, state: AppState) -> Caller:
    """The tenant and key of the portal session, if the key still works; else 401."""
    tenant_id, key_id = check_portal_request(request, state.admin_key)
    return service.session_caller(state, tenant_id, key_id)


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
    found = service.sign_in(state, api_key.strip())
    if found is None:  # unknown, revoked, expired, suspended: one answer for all
        return RedirectResponse("/portal/login?error=1", status_code=303)
    value, _ = new_portal_session(state.admin_key, *found)
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
class PortalTenant(BaseModel):
    id: int
    name: str
    price_prompt_per_1k: str  # decimals as strings: no float rounding on the way
    price_completion_per_1k: str
    batch_price_factor: str


class PortalKeyRef(BaseModel):
    id: int
    name: str
    prefix: str


class AccountPublic(BaseModel):
    tenant: PortalTenant
    key: PortalKeyRef
    limits: dict[str, int | None]
    used: dict[str, int]
    left: dict[str, int | None]  # of each used limit; None where it is unlimited
    month_resets_at: str


def _left(limit: int | None, used: int) -> int | None:
    return None if limit is None else max(0, limit - used)


@api.get("/account")
def account(state: StateDep, caller: PortalCaller) -> AccountPublic:
    """The tenant, its prices, its quotas and how much of each is left now."""
    acct = service.account(state, caller)
    t = caller.tenant
    return AccountPublic(
        tenant=PortalTenant(
            id=t.id,
            name=t.name,
            price_prompt_per_1k=format(t.price_prompt_per_1k, "f"),
            price_completion_per_1k=format(t.price_completion_per_1k, "f"),
            batch_price_factor=format(t.batch_price_factor, "f"),
        ),
        key=PortalKeyRef(id=caller.key.id, name=caller.key.name, prefix=caller.key.prefix),
        limits=acct.limits,
        used=acct.used,
        left={k: _left(acct.limits[k], v) for k, v in acct.used.items()},
        month_resets_at=acct.month_resets_at.isoformat(),
    )


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
class PortalKey(ApiKeyPublic):
    current: bool  # the key this session signed in with


@api.get("/guardrails")
def guardrails(state: StateDep, caller: PortalCaller) -> dict:
    """The tenant's guardrail policies and its newest audit events (platform/guardrails/)."""
    with state.sessions() as session:
        policies = guardrail_routes.my_policies(caller, session).data
        events = guardrail_routes.my_events(caller, session, None, 100).data
    return {"policies": [p.model_dump(mode="json") for p in policies],
            "events": [e.model_dump(mode="json") for e in events]}  # fmt: skip


@api.put("/guardrails/policies/{policy_id}/record_text")
def set_guardrail_record_text(policy_id: int, body: guardrail_routes.RecordTextIn,
                              state: StateDep, caller: PortalCaller) -> dict:  # fmt: skip
    """The portal's switch for the tenant's opt-in to recorded text: the handler of
    `PATCH /v1/guardrails/policies/{id}` (the same checks, 404 and audit event)."""
    with state.sessions() as session:
        policy = guardrail_routes.set_record_text(policy_id, body, caller, session)
    return policy.model_dump(mode="json")


@api.get("/keys")
def list_keys(state: StateDep, caller: PortalCaller) -> ListOf[PortalKey]:
    keys = service.list_keys(state, caller)
    return ListOf[PortalKey](
        data=[PortalKey(**k.model_dump(), current=k.id == caller.key.id) for k in keys]
    )


@api.post("/keys", status_code=201)
def create_key(
    state: StateDep,
    caller: PortalCaller,
    response: Response,
    body: Annotated[KeyIn | None, Body()] = None,
) -> ApiKeyCreated:
    """A new key of the tenant's; `secret` is in this response only."""
    body = body or KeyIn()
    created = service.create_key(state, caller, name=body.name, expires_at=body.expires_at)
    response.headers["Cache-Control"] = "no-store"  # no proxy or browser may keep the secret
    return created


@api.post("/keys/{key_id}/revoke")
def revoke_key(key_id: int, state: StateDep, caller: PortalCaller) -> ApiKeyPublic:
    """Revoke one of the tenant's keys (idempotent); another tenant's key is not found.
    Revoking the key this session signed in with ends the session."""
    return service.revoke_key(state, caller, key_id)


# ---------------------------------------------------------------------------------- usage
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
    batch_price_factor, rows = service.usage_report(state, caller, lo, hi)
    if fmt == "csv":
        filename = f"loraplex-usage-{caller.tenant.name}-{lo.date()}_{last_day(hi)}.csv"
        return Response(
            usage.to_csv(rows, row_type=service.PortalUsageRow),
            media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )
    total = sum((r.cost for r in rows), Decimal(0))
    return JSONResponse(
        {
            "object": "list",
            "period_start": lo.isoformat(),
            "period_end": hi.isoformat(),
            "batch_price_factor": format(batch_price_factor, "f"),
            "total_cost": format(total, "f"),
            "data": json.loads(usage.to_json(rows)),
        }
    )


class LatencyRow(BaseModel):
    adapter: str | None  # None: the base model
    requests: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None


class LatencyReport(BaseModel):
    object: Literal["list"] = "list"
    period_start: str
    period_end: str  # exclusive
    data: list[LatencyRow]


@api.get("/latency")
def latency(
    state: StateDep, caller: PortalCaller, start: str | None = None, end: str | None = None
) -> LatencyReport:
    """p50/p99 time to first token and per output token of the tenant's requests in
    [start, end] (the current month by default), per adapter (the base model as null)."""
    try:
        lo, hi = period(start, end)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_period") from None
    rows = service.latency(state, caller, lo, hi)
    return LatencyReport(
        period_start=lo.isoformat(),
        period_end=hi.isoformat(),
        data=[
            LatencyRow(
                adapter=r.key,
                requests=r.requests,
                errors=r.errors,
                ttft_p50_ms=r.ttft_p50,
                ttft_p99_ms=r.ttft_p99,
                tpot_p50_ms=r.tpot_p50,
                tpot_p99_ms=r.tpot_p99,
            )
            for r in rows
        ],
    )


def mount(app: FastAPI) -> None:
    """Add the portal's pages, its API and its static files (the dashboard's) to `app`."""
    app.include_router(pages)
    app.include_router(api)
    app.mount("/portal/static", StaticFiles(directory=UI_DIR / "static"), name="portal-static")
