"""Guardrail policies and their audit trail over HTTP.

Admin (under /admin/api, the admin check of `admin.py`): create, list, edit and delete a
tenant's policies; the events of every tenant; the per-tenant counts of a period. Tenant (under
/v1, its API key): its own policies and events, and its opt-in to recorded text per policy (the
only field of a policy it may change: the text is its own prompts and answers).

Every edit of a policy (the operator's, or the tenant's opt-in) leaves an audit event with
action `policy_edit` beside the policy's decisions: who (the key, or none for the operator),
when, and each changed field's old and new value (`policy_audit.py`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform.api.deps import CallerDep, SessionDep
from loraplex.platform.db import crud
from loraplex.platform.db.models import ApiKey, GuardrailPolicy
from loraplex.platform.errors import APIError
from loraplex.platform.guardrails import audit
from loraplex.platform.guardrails.checks import check_rules
from loraplex.platform.guardrails.policy_audit import record_edit
from loraplex.platform.periods import period

admin_router = APIRouter(tags=["guardrails"])
tenant_router = APIRouter(tags=["guardrails"])


class PolicyIn(BaseModel):
    # Unknown fields refused: a misspelt "action" must not leave a policy that enforces nothing.
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64)
    stages: Literal["input", "output", "both"] = "both"
    action: Literal["block", "redact", "flag"] = "block"
    terms: list[Annotated[str, Field(max_length=200)]] = Field(default=[], max_length=1000)
    patterns: list[Annotated[str, Field(max_length=500)]] = Field(default=[], max_length=100)
    pii: list[str] = []
    guard_adapter: str | None = Field(default=None, max_length=160)
    guard_tenant_id: int | None = None  # the operator's tenant that shares the guard adapter
    guard_threshold: float = Field(default=0.5, gt=0.0, le=1.0)
    fail_mode: Literal["open", "closed"] = "closed"
    record_text: bool = False
    api_key_id: int | None = None  # one key's requests only


class PolicyPatch(BaseModel):
    """The fields to change, each as in `PolicyIn`; a field left out keeps its value. The
    result is checked as a whole, as a new policy is (a policy left with no check is a 400).
    `guard_adapter: null` removes the guard (and its `guard_tenant_id`); a guard named where
    there was none is the policy's own tenant's unless `guard_tenant_id` says otherwise."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = Field(default=None, min_length=1, max_length=64)
    stages: Literal["input", "output", "both"] | None = None
    action: Literal["block", "redact", "flag"] | None = None
    terms: list[Annotated[str, Field(max_length=200)]] | None = Field(default=None, max_length=1000)
    patterns: list[Annotated[str, Field(max_length=500)]] | None = Field(
        default=None, max_length=100
    )
    pii: list[str] | None = None
    guard_adapter: str | None = Field(default=None, max_length=160)
    guard_tenant_id: int | None = None
    guard_threshold: float | None = Field(default=None, gt=0.0, le=1.0)
    fail_mode: Literal["open", "closed"] | None = None
    # No record_text: once a policy exists, whether its events keep the tenant's text is the
    # tenant's to say (PATCH /v1/guardrails/policies/{id}); the operator's edit is a 400.
    api_key_id: int | None = None


class RecordTextIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    record_text: bool


class PolicyOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    object: Literal["guardrail_policy"] = "guardrail_policy"
    tenant_id: int
    api_key_id: int | None
    name: str
    stages: str
    action: str
    terms: list[str]
    patterns: list[str]
    pii: list[str]
    guard_adapter: str | None
    guard_tenant_id: int | None
    guard_threshold: float
    fail_mode: str
    record_text: bool
    created_at: datetime


class EventOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    object: Literal["guardrail_event"] = "guardrail_event"
    tenant_id: int
    api_key_id: int | None
    policy_id: int | None
    policy_name: str
    rule: str
    stage: str
    action: str
    request_id: str
    route: str
    text: str | None
    created_at: datetime


class Listing(BaseModel):
    object: Literal["list"] = "list"
    data: list


def _tenant(session: Session, tenant_id: int):
    tenant = crud.get_tenant(session, tenant_id=tenant_id)
    if tenant is None:
        raise APIError(404, f"no tenant with id {tenant_id}", "tenant_not_found", "tenant_id")
    return tenant


def _policies(session: Session, tenant_id: int) -> list[PolicyOut]:
    rows = session.scalars(
        select(GuardrailPolicy)
        .where(GuardrailPolicy.tenant_id == tenant_id)
        .order_by(GuardrailPolicy.id)
    )
    return [PolicyOut.model_validate(r) for r in rows]


def _checked(session: Session, tenant_id: int, body: PolicyIn) -> dict:
    """The policy's stored fields, once every check a new or edited policy must pass holds."""
    why = check_rules(body.terms, body.patterns, body.pii)
    if why is not None:
        raise APIError(400, why, "invalid_policy")
    if not (body.terms or body.patterns or body.pii or body.guard_adapter):
        raise APIError(400, "a policy needs terms, patterns, pii or a guard_adapter",
                       "invalid_policy")  # fmt: skip
    if body.api_key_id is not None:
        key = session.get(ApiKey, body.api_key_id)
        if key is None or key.tenant_id != tenant_id:
            raise APIError(404, f"tenant {tenant_id} has no key {body.api_key_id}",
                           "key_not_found", "api_key_id")  # fmt: skip
    if body.guard_tenant_id is not None:
        _tenant(session, body.guard_tenant_id)
    if body.guard_tenant_id is not None and not body.guard_adapter:
        raise APIError(400, "guard_tenant_id needs a guard_adapter", "invalid_policy")
    values = body.model_dump()
    if values["guard_adapter"] and values["guard_tenant_id"] is None:
        values["guard_tenant_id"] = tenant_id  # the owner is stored: see gate.load_policies
    return values


def _owned(session: Session, tenant_id: int, policy_id: int) -> GuardrailPolicy:
    row = session.get(GuardrailPolicy, policy_id)
    if row is None or row.tenant_id != tenant_id:
        raise APIError(404, f"tenant {tenant_id} has no guardrail policy {policy_id}",
                       "policy_not_found")  # fmt: skip
    return row


@admin_router.post("/tenants/{tenant_id}/guardrails", status_code=201)
def create_policy(tenant_id: int, body: PolicyIn, session: SessionDep) -> PolicyOut:
    """A policy for the tenant (or one of its keys); it applies from the next request."""
    _tenant(session, tenant_id)
    row = GuardrailPolicy(tenant_id=tenant_id, **_checked(session, tenant_id, body))
    session.add(row)
    session.commit()
    return PolicyOut.model_validate(row)


@admin_router.patch("/tenants/{tenant_id}/guardrails/{policy_id}")
def edit_policy(tenant_id: int, policy_id: int, body: PolicyPatch,
                session: SessionDep) -> PolicyOut:  # fmt: skip
    """Change some of a policy's fields; it applies from the next request. Checked as a whole
    before anything is written; the change is an audit event (`policy_edit`)."""
    row = _owned(session, tenant_id, policy_id)
    given = body.model_dump(exclude_unset=True)
    if "guard_adapter" in given and given["guard_adapter"] is None:
        given.setdefault("guard_tenant_id", None)  # no guard, no guard owner
    merged = {f: getattr(row, f) for f in PolicyIn.model_fields} | given
    try:
        policy = PolicyIn.model_validate(merged)
    except ValidationError as e:  # a field set to null that must have a value
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}", "invalid_policy", where) from None
    values = _checked(session, tenant_id, policy)
    record_edit(session, row, values, tenant_id=tenant_id, key_id=None, route="admin")
    session.commit()
    return PolicyOut.model_validate(row)


@admin_router.get("/tenants/{tenant_id}/guardrails")
def list_policies(tenant_id: int, session: SessionDep) -> Listing:
    _tenant(session, tenant_id)
    return Listing(data=_policies(session, tenant_id))


@admin_router.delete("/tenants/{tenant_id}/guardrails/{policy_id}", status_code=204)
def delete_policy(tenant_id: int, policy_id: int, session: SessionDep) -> Response:
    row = _owned(session, tenant_id, policy_id)
    session.delete(row)  # its events stay, their policy_id set to null (the name stays)
    session.commit()
    return Response(status_code=204)


Limit = Annotated[int, Query(ge=1, le=1000)]


@admin_router.get("/guardrails/events")
def admin_events(session: SessionDep, tenant_id: int | None = None,
                 request_id: str | None = None, limit: Limit = 100) -> Listing:  # fmt: skip
    """The newest events first, of every tenant or one."""
    rows = audit.list_events(session, tenant_id=tenant_id, request_id=request_id, limit=limit)
    return Listing(data=[EventOut.model_validate(r) for r in rows])


@admin_router.get("/guardrails/counts")
def admin_counts(session: SessionDep, start: str | None = None, end: str | None = None,
                 tenant_id: int | None = None) -> dict:  # fmt: skip
    """Events per tenant and action in a period (the current month by default)."""
    lo, hi = _period(start, end)
    counts = audit.counts(session, start=lo, end=hi, tenant_id=tenant_id)
    return {"object": "guardrail_counts", "period_start": lo, "period_end": hi,
            "data": [{"tenant_id": t, **c} for t, c in sorted(counts.items())]}  # fmt: skip


def _period(start, end):
    try:
        return period(start, end)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_period") from None


@tenant_router.get("/guardrails")
def my_policies(caller: CallerDep, session: SessionDep) -> Listing:
    """The policies on this tenant's requests (set by the operator)."""
    return Listing(data=_policies(session, caller.tenant.id))


@tenant_router.patch("/guardrails/policies/{policy_id}")
def set_record_text(policy_id: int, body: RecordTextIn, caller: CallerDep,
                    session: SessionDep) -> PolicyOut:  # fmt: skip
    """The tenant opts in (or out) of its events keeping the text that hit this policy; off
    unless it (or the operator, at creation) says so. Applies from the next request."""
    row = session.get(GuardrailPolicy, policy_id)
    if row is None or row.tenant_id != caller.tenant.id:  # another tenant's is not found
        raise APIError(404, f"no guardrail policy {policy_id}", "policy_not_found", "policy_id")
    record_edit(session, row, {"record_text": body.record_text}, tenant_id=row.tenant_id,
                key_id=caller.key.id, route="tenant")  # fmt: skip
    session.commit()
    return PolicyOut.model_validate(row)


@tenant_router.get("/guardrails/events")
def my_events(caller: CallerDep, session: SessionDep, request_id: str | None = None,
              limit: Limit = 100) -> Listing:  # fmt: skip
    rows = audit.list_events(
        session, tenant_id=caller.tenant.id, request_id=request_id, limit=limit
    )
    return Listing(data=[EventOut.model_validate(r) for r in rows])
