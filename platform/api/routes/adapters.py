"""A tenant's adapters: upload (validated before anything is kept; under a taken name, a new
version), in-place update, list, get, delete; versions and aliases (promote, canary split,
rollback)."""

from __future__ import annotations

import asyncio
import copy
import logging

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile

from loraplex.platform import adapter_versions as versions
from loraplex.platform.adapter_service import publish_version, remove_adapter, store_and_register
from loraplex.platform.adapter_versions import AdapterPublic, AliasIn, AliasPublic
from loraplex.platform.api.deps import CallerDep, StateDep
from loraplex.platform.api.errors import API_ERRORS, APIError
from loraplex.platform.api.form_limits import limited
from loraplex.platform.api.routes.admin import ListOf
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
from loraplex.platform.uploads.scratch import scratch_unavailable

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
                        "promote": {
                            "type": "boolean",
                            "description": "a new version of an existing name takes its "
                            "default alias (the first version always does)",
                        },
                    },
                }
            }
        },
    }
}


_PUT_FORM = copy.deepcopy(_UPLOAD_FORM)
_PUT_SCHEMA = _PUT_FORM["requestBody"]["content"]["multipart/form-data"]["schema"]
_PUT_SCHEMA["required"] = ["files"]
del _PUT_SCHEMA["properties"]["name"], _PUT_SCHEMA["properties"]["promote"]
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


async def _received(request: Request, state, caller, ws, *, named: bool):
    """The form's adapter folder, validated (and its `name` and `promote` fields)."""
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
    form = await body.form(max_files=4, max_fields=5)
    try:
        name = form.get("name")
        if named and not is_adapter_name(name):
            raise APIError(
                400, f"form field 'name' is required: {ADAPTER_NAME_RULE}", "invalid_name", "name"
            )
        if named and name == state.model_name:
            raise APIError(
                400, f"'{name}' is the base model's name; choose another", "invalid_name", "name"
            )
        promote = str(form.get("promote") or "").strip().lower()
        if promote not in _TRUE + _FALSE:
            raise APIError(400, "form field 'promote' is true or false", "invalid_value", "promote")
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
        folder = await areceive_files(parts, ws, max_bytes=limit)
        info = await asyncio.to_thread(
            validate_adapter,
            folder,
            state.spec,
            max_rank=max_rank,
            base_model_name=state.model_name,
            max_bytes=limit,
            max_weight=settings.max_adapter_weight,
        )
        return name, promote in _TRUE, folder, info
    finally:
        await form.close()


async def _register(request: Request, state, caller, name: str | None, publish: bool):
    """Receive, validate, store and register one upload as a new version; its public view."""
    tmp_root = state.settings.data_dir / "tmp"
    try:
        with upload_workspace(tmp_root) as ws:
            named, promote, folder, info = await _received(
                request, state, caller, ws, named=name is None
            )
            name = name or named
            if publish:
                keep = state.settings.adapter_versions_kept
                row = await asyncio.to_thread(
                    publish_version, state, caller.tenant.id, name, folder, info, keep=keep
                )
            else:
                row = await asyncio.to_thread(
                    store_and_register, state, caller.tenant.id, name, folder, info,
                    promote=promote,
                )  # fmt: skip
    except UploadError as e:
        state.metrics.uploads.labels("refused").inc()
        raise APIError(e.status_code, e.message, e.code) from None
    except StoreError as e:  # store down, its folder gone, its disk full
        state.metrics.uploads.labels("refused").inc()
        raise store_unavailable(caller.tenant.id, name or "?", e) from None
    except OSError as e:  # the stores wrap their own: this is the scratch folder's disk
        state.metrics.uploads.labels("refused").inc()
        raise scratch_unavailable(caller.tenant.id, name or "?", e) from None
    state.metrics.uploads.labels("ok").inc()
    with state.sessions() as session:
        rows = crud.list_adapters(session, tenant_id=caller.tenant.id, name=row.name)
        aliases = crud.list_aliases(session, tenant_id=caller.tenant.id, name=row.name)
        current = next((r for r in rows if r.version == row.version), None)
        return versions.describe(rows or [row], aliases, current)


@router.post("", status_code=201, openapi_extra=_UPLOAD_FORM)
async def upload_adapter(request: Request, state: StateDep, caller: CallerDep) -> AdapterPublic:
    """Upload an adapter; under a name the tenant has, it becomes the next version (the default
    alias moves to it only with `promote=true`)."""
    return await _register(request, state, caller, None, publish=False)


@router.put("/{name}", openapi_extra=_PUT_FORM)
async def update_adapter(
    name: str, request: Request, state: StateDep, caller: CallerDep
) -> AdapterPublic:
    """In-place update (training loops): the files become the name's next version and its
    default alias moves to it atomically; versions beyond the kept count that no alias uses
    are deleted. Requests already running finish on the weights they started with."""
    if not is_adapter_name(name):
        raise APIError(400, f"adapter name: {ADAPTER_NAME_RULE}", "invalid_name", "name")
    if name == state.model_name:
        raise APIError(400, f"'{name}' is the base model's name", "invalid_name", "name")
    return await _register(request, state, caller, name, publish=True)


@router.get("")
def list_adapters(state: StateDep, caller: CallerDep) -> ListOf[AdapterPublic]:
    with state.sessions() as session:
        rows = versions.list_public(session, tenant_id=caller.tenant.id)
        return ListOf[AdapterPublic](data=[a for _, a in rows])


def _checked(name: str) -> str:
    if not is_adapter_name(name):  # no such adapter can exist; the registry need not look
        raise versions.not_found(name)
    return name


@router.get("/{name}")
def get_adapter(name: str, state: StateDep, caller: CallerDep) -> AdapterPublic:
    with state.sessions() as session:
        return versions.get_public(session, tenant_id=caller.tenant.id, name=_checked(name))


@router.delete("/{name}")
def delete_adapter(name: str, state: StateDep, caller: CallerDep):
    """Delete the adapter: every version and alias."""
    tenant_id = caller.tenant.id
    with state.sessions() as session:
        try:
            if not remove_adapter(state, session, tenant_id=tenant_id, name=_checked(name)):
                raise versions.not_found(name)
        except (StoreError, OSError) as e:  # the store is down or its folder gone
            session.rollback()
            if crud.get_adapter(session, tenant_id=tenant_id, name=name, include_deleted=True):
                raise store_unavailable(tenant_id, name, e) from None
            # The row is gone, so the adapter is; the collector removes the bytes later.
    return {"id": name, "object": "adapter", "deleted": True}


@router.delete("/{name}/versions/{version}")
def delete_version(name: str, version: str, state: StateDep, caller: CallerDep):
    """Delete one version; 409 while an alias sends it traffic."""
    with state.sessions() as session:
        versions.delete_version(
            state, session, tenant_id=caller.tenant.id, name=_checked(name), version=version
        )
    return {"id": f"{name}@{version}", "object": "adapter.version", "deleted": True}


@router.put("/{name}/aliases/{alias}")
def set_alias(
    name: str, alias: str, body: AliasIn, state: StateDep, caller: CallerDep
) -> AliasPublic:
    """Point the alias at one version (promote) or split it between versions (canary)."""
    with state.sessions() as session:
        return versions.set_alias(
            session, tenant_id=caller.tenant.id, name=_checked(name), alias=alias, body=body
        )


@router.post("/{name}/aliases/{alias}/rollback")
def rollback_alias(name: str, alias: str, state: StateDep, caller: CallerDep) -> AliasPublic:
    """Put the alias back where it pointed before its last change."""
    with state.sessions() as session:
        return versions.rollback_alias(
            session, tenant_id=caller.tenant.id, name=_checked(name), alias=alias
        )


@router.delete("/{name}/aliases/{alias}")
def delete_alias(name: str, alias: str, state: StateDep, caller: CallerDep):
    """Delete an alias other than `default`."""
    with state.sessions() as session:
        versions.delete_alias(session, tenant_id=caller.tenant.id, name=_checked(name), alias=alias)
    return {"id": f"{name}@{alias}", "object": "adapter.alias", "deleted": True}
