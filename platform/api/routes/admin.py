"""Admin API (admin key only): tenants, quotas, API keys and every tenant's adapters.

Usage and billing routes live in `admin_usage.py`; they are included at the bottom, so they
share this router's prefix and admin check.
"""

from __future__ import annotations

from datetime import UTC
from typing import Annotated, Generic, Literal, TypeVar

from fastapi import APIRouter, Body, Query, Response
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from loraplex.platform import adapter_versions as versions
from loraplex.platform.adapter_service import remove_adapter
from loraplex.platform.api.deps import AdminDep, SessionDep, StateDep
from loraplex.platform.api.errors import API_ERRORS, APIError
from loraplex.platform.api.routes import admin_cache, admin_usage
from loraplex.platform.db import crud
from loraplex.platform.db.models import AdapterStatus, Tenant, TenantStatus, utcnow
from loraplex.platform.db.schemas import (
    AdapterPublic,
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyPublic,
    QuotaBase,
    QuotaPublic,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
)
from loraplex.platform.guardrails import routes as guardrail_routes
from loraplex.platform.serving import InferenceService

router = APIRouter(
    prefix="/admin/api", tags=["admin"], dependencies=[AdminDep], responses=API_ERRORS
)

T = TypeVar("T")


class ListOf(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]


# Bodies refuse unknown fields: a misspelt limit in a quota PUT would otherwise silently make
# the tenant unlimited, and a misspelt field in a PATCH would silently change nothing. They
# are strict about JSON types too ("10" is not a limit of 10), as the OpenAI routes are.
class TenantIn(TenantCreate):
    model_config = ConfigDict(extra="forbid", strict=True)


class TenantPatch(TenantUpdate):
    model_config = ConfigDict(extra="forbid", strict=True, use_enum_values=True)


class QuotaIn(QuotaBase):
    model_config = ConfigDict(extra="forbid", strict=True)


class KeyIn(ApiKeyCreate):
    model_config = ConfigDict(extra="forbid", strict=True)


class AdminAdapter(AdapterPublic):
    tenant: str  # the owner's name, so operators need no second lookup
    # The aliases of its name that send this version traffic, with their weight
    # in percent ({"default": 90}): the list shows where each name's traffic goes.
    aliases: dict[str, int] = {}


EndStreams = Annotated[
    bool,
    Query(description="also end the tenant's (or key's) running streams on this replica now"),
]


def _end_streams(state, response: Response, tenant_id: int, key_id: int | None = None) -> None:
    """End the running streams of the tenant (or of its key) on this replica: each gets an
    `error` event (code `stream_cut`) and `[DONE]`, billed for what it was sent. Streams on
    other replicas run on (call each replica); `Loraplex-Streams-Ended` says how many ended."""
    ended = InferenceService(state).cut_streams(tenant_id, key_id)
    response.headers["Loraplex-Streams-Ended"] = str(ended)


def _tenant(session: Session, tenant_id: int) -> Tenant:
    tenant = crud.get_tenant(session, tenant_id=tenant_id)
    if tenant is None:
        raise APIError(404, f"no tenant with id {tenant_id}", "tenant_not_found", "tenant_id")
    return tenant


# --- tenants -------------------------------------------------------------------------------


@router.get("/tenants")
def list_tenants(session: SessionDep, status: TenantStatus | None = None) -> ListOf[TenantPublic]:
    rows = crud.list_tenants(session, status=status)
    return ListOf[TenantPublic](data=[TenantPublic.model_validate(t) for t in rows])


@router.post("/tenants", status_code=201)
def create_tenant(body: TenantIn, session: SessionDep) -> TenantPublic:
    try:
        tenant = crud.create_tenant(session, **body.model_dump())
    except crud.Conflict as e:
        raise APIError(409, str(e), "tenant_exists", "name") from None
    return TenantPublic.model_validate(tenant)


@router.get("/tenants/{tenant_id}")
def get_tenant(tenant_id: int, session: SessionDep) -> TenantPublic:
    return TenantPublic.model_validate(_tenant(session, tenant_id))


@router.patch("/tenants/{tenant_id}")
def update_tenant(
    tenant_id: int,
    body: TenantPatch,
    session: SessionDep,
    state: StateDep,
    response: Response,
    end_streams: EndStreams = False,
) -> TenantPublic:
    """Change weight, prices or status (`active` | `suspended`; a suspended tenant's keys are
    refused with 401 until it is active again). Fields left out stay as they are.

    A suspension lets the tenant's running streams finish, unless `end_streams=true`: then
    they end at once on this replica (see `_end_streams`)."""
    _tenant(session, tenant_id)
    changes = body.model_dump(exclude_unset=True)
    if not changes:
        raise APIError(
            400,
            "nothing to update: send one or more of weight, price_prompt_per_1k, "
            "price_completion_per_1k, status",
            "invalid_value",
        )
    if end_streams and changes.get("status") != TenantStatus.suspended:
        msg = 'end_streams goes with a suspension: send "status": "suspended"'
        raise APIError(400, msg, "invalid_value", "end_streams")
    tenant = crud.update_tenant(session, tenant_id=tenant_id, **changes)
    if end_streams:
        _end_streams(state, response, tenant_id)
    return TenantPublic.model_validate(tenant)


# --- quotas --------------------------------------------------------------------------------


@router.get("/tenants/{tenant_id}/quota")
def get_quota(tenant_id: int, session: SessionDep) -> QuotaPublic:
    """The tenant's limits; null is unlimited (also for a tenant that never had a quota)."""
    _tenant(session, tenant_id)
    quota = crud.get_quota(session, tenant_id=tenant_id)
    return QuotaPublic.model_validate(quota) if quota else QuotaPublic(tenant_id=tenant_id)


@router.put("/tenants/{tenant_id}/quota")
def put_quota(tenant_id: int, body: QuotaIn, session: SessionDep) -> QuotaPublic:
    """Replace all the tenant's limits: a limit left out or null is unlimited."""
    _tenant(session, tenant_id)
    quota = crud.set_quota(session, tenant_id=tenant_id, **body.model_dump())
    return QuotaPublic.model_validate(quota)


# --- API keys ------------------------------------------------------------------------------


@router.get("/tenants/{tenant_id}/keys")
def list_keys(tenant_id: int, session: SessionDep) -> ListOf[ApiKeyPublic]:
    """The tenant's keys, revoked ones included: display prefix only, never the secret."""
    _tenant(session, tenant_id)
    return ListOf[ApiKeyPublic](data=crud.list_keys(session, tenant_id=tenant_id))


@router.post("/tenants/{tenant_id}/keys", status_code=201)
def create_key(
    tenant_id: int,
    session: SessionDep,
    response: Response,
    body: Annotated[KeyIn | None, Body()] = None,
) -> ApiKeyCreated:
    """A new key; `secret` is in this response only (the registry keeps its hash)."""
    _tenant(session, tenant_id)
    body = body or KeyIn()
    expires_at = body.expires_at
    if expires_at is not None:
        # Naive times are UTC, as everywhere in the registry.
        expires_at = expires_at.replace(tzinfo=UTC) if expires_at.tzinfo is None else expires_at
        if expires_at <= utcnow():
            raise APIError(
                400, "expires_at is in the past: the key would never work", "invalid_value"
            )
    secret, key = crud.create_key(
        session, tenant_id=tenant_id, name=body.name, expires_at=expires_at
    )
    response.headers["Cache-Control"] = "no-store"  # no proxy or browser may keep the secret
    return ApiKeyCreated(**ApiKeyPublic.model_validate(key).model_dump(), secret=secret)


@router.post("/keys/{key_id}/revoke")
@router.delete("/keys/{key_id}")
def revoke_key(
    key_id: int,
    session: SessionDep,
    state: StateDep,
    response: Response,
    end_streams: EndStreams = False,
) -> ApiKeyPublic:
    """Revoke a key at once (idempotent). The row stays: usage records refer to it. Streams
    running on the key finish, unless `end_streams=true` (see `_end_streams`)."""
    try:
        key = crud.revoke_key(session, key_id=key_id)
    except crud.NotFound as e:
        raise APIError(404, str(e), "key_not_found", "key_id") from None
    if end_streams:
        _end_streams(state, response, key.tenant_id, key.id)
    return ApiKeyPublic.model_validate(key)


# --- adapters ------------------------------------------------------------------------------


@router.get("/adapters")
def list_adapters(
    session: SessionDep, tenant_id: int | None = None, status: AdapterStatus | None = None
) -> ListOf[AdminAdapter]:
    """Every version of every tenant's adapters (or one tenant's), without storage internals."""
    if tenant_id is not None:
        _tenant(session, tenant_id)
    names = {t.id: t.name for t in crud.list_tenants(session)}
    rows = crud.list_adapters(session, tenant_id=tenant_id, status=status)
    routed: dict[tuple[int, str, int], dict[str, int]] = {}
    for alias in crud.list_aliases(session, tenant_id=tenant_id):
        total = sum(alias.weights.values())
        for version, weight in alias.weights.items():
            share = round(100 * weight / total)
            routed.setdefault((alias.tenant_id, alias.name, int(version)), {})[alias.alias] = share
    return ListOf[AdminAdapter](
        data=[
            AdminAdapter(
                **AdapterPublic.model_validate(a).model_dump(),
                tenant=names[a.tenant_id],
                aliases=routed.get((a.tenant_id, a.name, a.version), {}),
            )
            for a in rows
        ]
    )


@router.get("/tenants/{tenant_id}/adapters/{name}")
def get_adapter(tenant_id: int, name: str, session: SessionDep) -> versions.AdapterPublic:
    """A tenant's adapter with its versions and aliases."""
    _tenant(session, tenant_id)
    return versions.get_public(session, tenant_id=tenant_id, name=name)


@router.put("/tenants/{tenant_id}/adapters/{name}/aliases/{alias}")
def set_alias(
    tenant_id: int, name: str, alias: str, body: versions.AliasIn, session: SessionDep
) -> versions.AliasPublic:
    """Promote a version of a tenant's adapter, or split an alias between versions."""
    _tenant(session, tenant_id)
    return versions.set_alias(session, tenant_id=tenant_id, name=name, alias=alias, body=body)


@router.post("/tenants/{tenant_id}/adapters/{name}/aliases/{alias}/rollback")
def rollback_alias(
    tenant_id: int, name: str, alias: str, session: SessionDep
) -> versions.AliasPublic:
    """Put a tenant's alias back where it pointed before its last change."""
    _tenant(session, tenant_id)
    return versions.rollback_alias(session, tenant_id=tenant_id, name=name, alias=alias)


@router.delete("/tenants/{tenant_id}/adapters/{name}/versions/{version}")
def delete_version(
    tenant_id: int, name: str, version: str, session: SessionDep, state: StateDep
) -> dict:
    """Remove one version of a tenant's adapter; 409 while an alias sends it traffic."""
    _tenant(session, tenant_id)
    versions.delete_version(state, session, tenant_id=tenant_id, name=name, version=version)
    return {"id": f"{name}@{version}", "object": "adapter.version", "tenant_id": tenant_id,
            "deleted": True}  # fmt: skip


@router.delete("/tenants/{tenant_id}/adapters/{name}")
def delete_adapter(tenant_id: int, name: str, session: SessionDep, state: StateDep) -> dict:
    """Remove a tenant's adapter (every version), and its stored files."""
    _tenant(session, tenant_id)
    if not remove_adapter(state, session, tenant_id=tenant_id, name=name):
        raise APIError(
            404, f"tenant {tenant_id} has no adapter named '{name}'", "adapter_not_found"
        )
    return {"id": name, "object": "adapter", "tenant_id": tenant_id, "deleted": True}


router.include_router(admin_usage.router)
router.include_router(guardrail_routes.admin_router)  # platform/guardrails/routes.py
router.include_router(admin_cache.router)  # a tenant's prefix-cache salt
