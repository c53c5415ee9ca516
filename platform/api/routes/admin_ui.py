"""The admin dashboard at /admin: sign-in, its static files, and its live-stats endpoint.

The pages are plain HTML + JavaScript modules from the `admin_ui/` folder (package
`loraplex.admin_ui`), all served from here, so a browser without internet access works. The
pages call the admin API (`/admin/api/...`) with the session cookie; see `admin_session`.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from importlib.resources import files
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, FastAPI, Form, Request
from fastapi.responses import FileResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy import func, select

from loraplex.platform.admin_session import (
    SESSION_COOKIE,
    check_session_request,
    clear_session_cookie,
    csrf_token,
    new_session,
    session_expiry,
    set_session_cookie,
)
from loraplex.platform.api.deps import AdminDep, SessionDep, StateDep
from loraplex.platform.api.errors import API_ERRORS, APIError
from loraplex.platform.api.routes.inference import architecture
from loraplex.platform.batches import batch_public
from loraplex.platform.db.models import Batch, Tenant, UsageRecord, utcnow
from loraplex.platform.security import constant_time_equals

UI_DIR = Path(str(files("loraplex.admin_ui")))
RATE_WINDOW_S = 10  # requests/s and tokens/s are averages over this many seconds

# No inline script or style anywhere: the pages work under a strict policy, which also stops an
# injected tenant or adapter name from ever running as code.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix="/admin", tags=["admin dashboard"], include_in_schema=False)
stats_router = APIRouter(
    prefix="/admin/api", tags=["admin"], dependencies=[AdminDep], responses=API_ERRORS
)


def _page(name: str) -> Response:
    return FileResponse(UI_DIR / name, media_type="text/html", headers=_HEADERS)


def _signed_in(request: Request, admin_key: str) -> bool:
    return session_expiry(admin_key, request.cookies.get(SESSION_COOKIE, "")) is not None


@router.get("")
def dashboard(request: Request, state: StateDep) -> Response:
    if not _signed_in(request, state.admin_key):
        return RedirectResponse("/admin/login", status_code=303)
    return _page("index.html")


@router.get("/login")
def login_page(request: Request, state: StateDep) -> Response:
    if _signed_in(request, state.admin_key):
        return RedirectResponse("/admin", status_code=303)
    return _page("login.html")


@router.post("/login")
def login(
    request: Request, state: StateDep, admin_key: Annotated[str, Form(max_length=4096)] = ""
) -> Response:
    """Check the admin key once and swap it for a signed session cookie."""
    if not admin_key or not constant_time_equals(admin_key.strip(), state.admin_key):
        return RedirectResponse("/admin/login?error=1", status_code=303)
    value, _ = new_session(state.admin_key)
    response = RedirectResponse("/admin", status_code=303)
    set_session_cookie(response, request, value)
    return response


@router.post("/logout", status_code=204)
def logout(request: Request, state: StateDep) -> Response:
    check_session_request(request, state.admin_key)  # CSRF: no other site may sign us out
    response = Response(status_code=204)
    clear_session_cookie(response)
    return response


@router.get("/session")
def session_info(request: Request, state: StateDep) -> dict:
    """The CSRF token for this session's state-changing requests, and when it expires."""
    check_session_request(request, state.admin_key)
    value = request.cookies[SESSION_COOKIE]
    return {
        "csrf_token": csrf_token(state.admin_key, value),
        "expires_at": session_expiry(state.admin_key, value),
    }


@stats_router.get("/stats")
def live_stats(state: StateDep, session: SessionDep) -> dict:
    """Rates over the last seconds from the shared usage ledger (so: every replica together),
    and the engine gauges of the replica that answered (queue, KV cache, adapter slots)."""
    since = utcnow() - timedelta(seconds=RATE_WINDOW_S)
    requests, tokens = session.execute(
        select(
            func.count(UsageRecord.id),
            func.coalesce(func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens), 0),
        ).where(UsageRecord.created_at >= since)
    ).one()
    body: dict = {
        "window_s": RATE_WINDOW_S,
        "requests_per_s": requests / RATE_WINDOW_S,
        "tokens_per_s": int(tokens) / RATE_WINDOW_S,
        "replica": socket.gethostname(),
        "model": state.model_name,
        # the base's family and, for a mixture of experts, its routing (as /v1/models says)
        "architecture": architecture(state.spec),
        "ready": state.engine is not None,
        "engine": None,
    }
    if state.engine is not None:
        s = state.engine.stats()
        body["engine"] = {
            "running": s.running,
            "waiting": s.waiting,
            "kv_usage": s.kv_usage,
            "kv_blocks": s.kv_blocks,
            "adapter_slots_used": s.adapter_slots_used,
            "adapter_slots": s.adapter_slots,
            "adapters_in_host": s.adapters_in_host,
            "adapter_hits": s.adapter_hits,
            "adapter_loads": s.adapter_loads,
            "adapter_load_seconds": s.adapter_load_seconds,
            "adapter_load_failures": s.adapter_load_failures,
            "preemptions": s.preemptions,
            "kv_tiers": _kv_tiers(s),
        }
    return body


def _kv_tiers(s) -> dict:
    """Per KV tier (docs/kv-tiers.md) since the engine started: blocks looked up and found
    (hit rate = hits / queried), bytes read and written, and bytes held now (host, disk; the
    shared store's size is its own); empty when the tiers are off."""
    return {
        tier: {
            "queried": queried,
            "hits": s.kv_tier_hits.get(tier, 0),
            "hit_rate": s.kv_tier_hits.get(tier, 0) / queried if queried else None,
            "bytes_read": s.kv_tier_bytes_read.get(tier, 0),
            "bytes_written": s.kv_tier_bytes_written.get(tier, 0),
            "bytes_stored": s.kv_tier_bytes_stored.get(tier),
        }
        for tier, queried in s.kv_tier_queried.items()
    }


@stats_router.get("/tenants/{tenant_id}/batches")
def tenant_batches(tenant_id: int, session: SessionDep, limit: int = 50) -> dict:
    """The tenant's Batch API jobs, newest first, as the tenant's `GET /v1/batches` shows them
    (state, request counts: the dashboard draws their progress)."""
    if not 1 <= limit <= 200:
        raise APIError(400, "'limit' must be from 1 to 200", "invalid_value", "limit")
    if session.get(Tenant, tenant_id) is None:
        raise APIError(404, f"no tenant with id {tenant_id}", "tenant_not_found", "tenant_id")
    rows = session.scalars(
        select(Batch)
        .where(Batch.tenant_id == tenant_id)
        .order_by(Batch.created_at.desc(), Batch.id.desc())
        .limit(limit)
    )
    return {"object": "list", "data": [batch_public(session, row) for row in rows]}


def mount(app: FastAPI) -> None:
    """Add the dashboard's pages, its stats endpoint and its static files to `app`."""
    app.include_router(router)
    app.include_router(stats_router)
    app.mount("/admin/static", StaticFiles(directory=UI_DIR / "static"), name="admin-static")
