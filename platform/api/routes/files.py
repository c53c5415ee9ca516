"""OpenAI's Files API for the Batch API: upload (purpose "batch"), list, get, content, delete."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sqlalchemy import select
from starlette.datastructures import UploadFile

from loraplex.platform.api.deps import CallerDep, StateDep
from loraplex.platform.api.errors import API_ERRORS, APIError
from loraplex.platform.api.form_limits import limited
from loraplex.platform.db.models import Batch, BatchStatus, StoredFile
from loraplex.platform.files import (
    FileBlobs,
    create_file,
    file_public,
    get_file,
    parse_batch_input,
    tenant_file_bytes,
)
from loraplex.platform.store import StoreError

router = APIRouter(prefix="/v1/files", tags=["files"], responses=API_ERRORS)
log = logging.getLogger("loraplex.platform")
_ACTIVE = (
    BatchStatus.validating,
    BatchStatus.in_progress,
    BatchStatus.finalizing,
    BatchStatus.cancelling,
)


def cursor_page(data: list[dict], has_more: bool) -> dict:
    """OpenAI's list object, with the cursors its `after` parameter pages by."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def store_unavailable(cause: Exception) -> APIError:
    # The cause names store folders and buckets: the log gets it, the client what to do.
    log.warning("the Files API's store failed: %s", cause)
    return APIError(
        503, "the file store is unavailable; retry later", "store_unavailable",
        headers={"Retry-After": "30"},
    )  # fmt: skip


_UPLOAD_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["purpose", "file"],
                    "properties": {
                        "purpose": {"type": "string", "enum": ["batch"]},
                        "file": {"type": "string", "format": "binary"},
                    },
                }
            }
        },
    }
}


@router.post("", openapi_extra=_UPLOAD_FORM)
async def upload_file(request: Request, state: StateDep, caller: CallerDep):
    settings = state.settings
    limit = settings.batch_file_max_bytes
    body = limited(request, limit)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "multipart/form-data":
        raise APIError(
            415,
            f"a file upload is a multipart/form-data form (purpose + file), not {kind or 'none'}",
            "unsupported_media_type",
        )
    form = await body.form(max_files=1, max_fields=2)
    try:
        purpose = form.get("purpose")
        if purpose != "batch":
            raise APIError(
                400, "form field 'purpose' must be \"batch\"", "invalid_purpose", "purpose"
            )
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "form field 'file' (the JSONL file) is required", "missing_file",
                           "file")  # fmt: skip
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise APIError(413, f"the file exceeds the limit of {limit} bytes", "too_large")
        requests = parse_batch_input(data, max_lines=settings.batch_file_max_lines)
        filename = upload.filename or "batch.jsonl"
    finally:
        await form.close()

    def store():
        with state.sessions() as session:
            cap = settings.files_max_bytes_per_tenant
            if cap is not None:
                used = tenant_file_bytes(session, tenant_id=caller.tenant.id)
                if used + len(data) > cap:
                    raise APIError(
                        403,
                        f"storing this file ({len(data)} bytes) would exceed the tenant's "
                        f"limit of {cap} bytes of files ({used} in use); delete some files",
                        "quota_exceeded",
                    )
            row = create_file(
                session,
                FileBlobs(state.store),
                tenant_id=caller.tenant.id,
                purpose="batch",
                filename=filename,
                data=data,
                lines=len(requests),
            )
            return file_public(row)

    try:
        return await asyncio.to_thread(store)
    except StoreError as e:
        raise store_unavailable(e) from None


@router.get("")
def list_files(
    state: StateDep,
    caller: CallerDep,
    purpose: str | None = None,
    limit: int = 10000,
    after: str | None = None,
    order: str = "desc",
):
    if order not in ("asc", "desc"):
        raise APIError(400, "'order' must be 'asc' or 'desc'", "invalid_value", "order")
    if not 1 <= limit <= 10000:
        raise APIError(400, "'limit' must be from 1 to 10000", "invalid_value", "limit")
    with state.sessions() as session:
        query = select(StoredFile).where(StoredFile.tenant_id == caller.tenant.id)
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        key = (StoredFile.created_at, StoredFile.id)
        if after is not None:
            try:
                cursor = get_file(session, tenant_id=caller.tenant.id, file_id=after)
            except APIError as e:
                e.param = "after"
                raise
            older = (StoredFile.created_at < cursor.created_at) | (
                (StoredFile.created_at == cursor.created_at) & (StoredFile.id < cursor.id)
            )
            newer = (StoredFile.created_at > cursor.created_at) | (
                (StoredFile.created_at == cursor.created_at) & (StoredFile.id > cursor.id)
            )
            query = query.where(older if order == "desc" else newer)
        query = query.order_by(*(k.desc() if order == "desc" else k.asc() for k in key))
        rows = list(session.scalars(query.limit(limit + 1)))
    return cursor_page([file_public(r) for r in rows[:limit]], len(rows) > limit)


@router.get("/{file_id}")
def retrieve_file(file_id: str, state: StateDep, caller: CallerDep):
    with state.sessions() as session:
        return file_public(get_file(session, tenant_id=caller.tenant.id, file_id=file_id))


@router.get("/{file_id}/content")
def file_content(file_id: str, state: StateDep, caller: CallerDep):
    with state.sessions() as session:
        row = get_file(session, tenant_id=caller.tenant.id, file_id=file_id)
    try:
        data = FileBlobs(state.store).get(row.storage_key)
    except StoreError as e:
        raise store_unavailable(e) from None
    return Response(data, media_type="application/jsonl")


@router.delete("/{file_id}")
def delete_file(file_id: str, state: StateDep, caller: CallerDep):
    with state.sessions() as session:
        row = get_file(session, tenant_id=caller.tenant.id, file_id=file_id)
        running = session.scalar(
            select(Batch.id).where(
                Batch.tenant_id == caller.tenant.id,
                Batch.input_file_id == file_id,
                Batch.status.in_([s.value for s in _ACTIVE]),
            )
        )
        if running is not None:
            raise APIError(
                409,
                f"file {file_id} is the input of batch {running}, which is still running; "
                "cancel it first",
                "file_in_use",
                "file_id",
            )
        key = row.storage_key
        session.delete(row)
        session.commit()
    try:
        FileBlobs(state.store).delete(key)
    except StoreError as e:  # the row is gone, so is the file; its bytes are left behind
        log.warning("stored file %s could not be removed: %s", key, e)
    return {"id": file_id, "object": "file", "deleted": True}
