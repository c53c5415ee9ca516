"""A tenant's adapters: upload (validated before anything is kept), list, get, delete."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile

from loraplex.platform.adapter_service import remove_adapter, store_and_register
from loraplex.platform.api.deps import CallerDep, StateDep
from loraplex.platform.api.errors import API_ERRORS, APIError
from loraplex.platform.api.form_limits import limited
from loraplex.platform.db import crud
from loraplex.platform.names import ADAPTER_NAME_PATTERN, ADAPTER_NAME_RULE, is_adapter_name
from loraplex.platform.store import StoreError
from loraplex.platform.uploads import (
    UploadError,
    areceive_files,
    upload_workspace,
    validate_adapter,
)
from loraplex.platform.uploads.policy import expected_files

router = APIRouter(prefix="/v1/adapters", tags=["adapters"], responses=API_ERRORS)
log = logging.getLogger("loraplex.platform")


# Room for the multipart framing and the name field around `limit` bytes of files.


def store_unavailable(tenant_id: int | str, name: str, cause: Exception) -> APIError:
    """The 503 of a change the store could not make. The cause names store folders, buckets
    and endpoints: the operator's log gets it, the client a message that says what to do."""
    log.warning("adapter %r of tenant %s: the store failed: %s", name, tenant_id, cause)
    return APIError(
        503,
        "the adapter store is unavailable; nothing was changed; retry later",
        "store_unavailable",
        headers={"Retry-After": "30"},
    )


def adapter_public(a) -> dict:
    return {
        "id": a.name,
        "object": "adapter",
        "name": a.name,
        "base_model": a.base_model,
        "rank": a.rank,
        "alpha": a.alpha,
        "targets": list(a.targets),
        "bytes": a.bytes,
        "sha256": a.sha256,
        "status": str(a.status),
        "created_at": a.created_at.isoformat(),
        "last_used_at": a.last_used_at.isoformat() if a.last_used_at else None,
    }


# The form is read by hand (to cap it as it arrives), so FastAPI cannot describe it: say it
# here, for clients and for the tests that walk every route's fields.
_UPLOAD_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name", "files"],
                    "properties": {
                        "name": {
                            "type": "string",
                            "pattern": ADAPTER_NAME_PATTERN,
                            "maxLength": 64,
                            "description": ADAPTER_NAME_RULE,
                        },
                        "files": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "description": expected_files(),
                        },
                    },
                }
            }
        },
    }
}


@router.post("", status_code=201, openapi_extra=_UPLOAD_FORM)
async def upload_adapter(request: Request, state: StateDep, caller: CallerDep):
    settings = state.settings
    limit = settings.max_upload_bytes
    with state.sessions() as session:
        quota = crud.get_quota(session, tenant_id=caller.tenant.id)
    if quota is not None and quota.max_adapter_bytes is not None:
        limit = min(limit, quota.max_adapter_bytes)
    body = limited(request, limit)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind and kind not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        raise APIError(
            415,
            f"an upload is a multipart/form-data form (name + files), not {kind}",
            "unsupported_media_type",
        )
    form = await body.form(max_files=4, max_fields=4)
    name = form.get("name")
    if not is_adapter_name(name):
        raise APIError(
            400,
            f"form field 'name' is required: {ADAPTER_NAME_RULE}",
            "invalid_name",
            "name",
        )
    if name == state.model_name:
        raise APIError(
            400, f"'{name}' is the base model's name; choose another", "invalid_name", "name"
        )
    parts = [(f.filename or "", f) for _, f in form.multi_items() if isinstance(f, UploadFile)]
    if not parts:
        raise APIError(
            400,
            "no files: send adapter_config.json and adapter_model.safetensors, "
            "or one .tar.gz/.zip of a PEFT folder",
            "missing_file",
        )
    max_rank = state.engine.config.max_lora_rank if state.engine else settings.max_lora_rank
    if quota is not None and quota.max_rank is not None:
        max_rank = min(max_rank, quota.max_rank)
    tmp_root = settings.data_dir / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    try:
        with upload_workspace(tmp_root) as ws:
            folder = await areceive_files(parts, ws, max_bytes=limit)
            info = await asyncio.to_thread(
                validate_adapter,
                folder,
                state.spec,
                max_rank=max_rank,
                base_model_name=state.model_name,
                max_bytes=limit,
            )
            row = await asyncio.to_thread(
                store_and_register, state, caller.tenant.id, name, folder, info
            )
    except UploadError as e:
        state.metrics.uploads.labels("refused").inc()
        raise APIError(e.status_code, e.message, e.code) from None
    except (StoreError, OSError) as e:  # store down, its folder gone, a full disk
        state.metrics.uploads.labels("refused").inc()
        raise store_unavailable(caller.tenant.id, name, e) from None
    finally:
        await form.close()
    state.metrics.uploads.labels("ok").inc()
    return adapter_public(row)


@router.get("")
def list_adapters(state: StateDep, caller: CallerDep):
    with state.sessions() as session:
        rows = crud.list_adapters(session, tenant_id=caller.tenant.id)
        return {"object": "list", "data": [adapter_public(a) for a in rows]}


def _not_found(name: str) -> APIError:
    return APIError(404, f"no adapter named {name[:80]!r}", "adapter_not_found", "name")


@router.get("/{name}")
def get_adapter(name: str, state: StateDep, caller: CallerDep):
    if not is_adapter_name(name):  # no such adapter can exist; the registry need not look
        raise _not_found(name)
    with state.sessions() as session:
        row = crud.get_adapter(session, tenant_id=caller.tenant.id, name=name)
        if row is None:
            raise _not_found(name)
        return adapter_public(row)


@router.delete("/{name}")
def delete_adapter(name: str, state: StateDep, caller: CallerDep):
    if not is_adapter_name(name):
        raise _not_found(name)
    tenant_id = caller.tenant.id
    with state.sessions() as session:
        try:
            if not remove_adapter(state, session, tenant_id=tenant_id, name=name):
                raise _not_found(name)
        except (StoreError, OSError) as e:  # the store is down or its folder gone
            session.rollback()
            if crud.get_adapter(session, tenant_id=tenant_id, name=name, include_deleted=True):
                raise store_unavailable(tenant_id, name, e) from None
            # The row is gone, so the adapter is; the collector removes the bytes later.
    return {"id": name, "object": "adapter", "deleted": True}
