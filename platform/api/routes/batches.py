"""OpenAI's Batch API: create, retrieve, list, cancel (the runner: platform/batch_runner.py)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from loraplex.platform.api.deps import CallerDep, StateDep
from loraplex.platform.api.errors import API_ERRORS, APIError
from loraplex.platform.api.routes.files import cursor_page
from loraplex.platform.batches import (
    BatchCreate,
    batch_public,
    cancel_batch,
    create_batch,
    get_batch,
)
from loraplex.platform.db.models import Batch

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=API_ERRORS)


@router.post("")
def create(body: BatchCreate, state: StateDep, caller: CallerDep):
    with state.sessions() as session:
        return batch_public(session, create_batch(session, caller=caller, body=body))


@router.get("")
def list_batches(state: StateDep, caller: CallerDep, limit: int = 20, after: str | None = None):
    if not 1 <= limit <= 100:
        raise APIError(400, "'limit' must be from 1 to 100", "invalid_value", "limit")
    with state.sessions() as session:
        query = select(Batch).where(Batch.tenant_id == caller.tenant.id)
        if after is not None:
            try:
                cursor = get_batch(session, tenant_id=caller.tenant.id, batch_id=after)
            except APIError as e:
                e.param = "after"
                raise
            query = query.where(
                (Batch.created_at < cursor.created_at)
                | ((Batch.created_at == cursor.created_at) & (Batch.id < cursor.id))
            )
        rows = list(
            session.scalars(
                query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
            )
        )
        data = [batch_public(session, r) for r in rows[:limit]]
    return cursor_page(data, len(rows) > limit)


@router.get("/{batch_id}")
def retrieve(batch_id: str, state: StateDep, caller: CallerDep):
    with state.sessions() as session:
        return batch_public(
            session, get_batch(session, tenant_id=caller.tenant.id, batch_id=batch_id)
        )


@router.post("/{batch_id}/cancel")
def cancel(batch_id: str, state: StateDep, caller: CallerDep):
    with state.sessions() as session:
        row = cancel_batch(session, tenant_id=caller.tenant.id, batch_id=batch_id)
        return batch_public(session, row)
