"""vLLM's runtime adapter endpoints, for operators who script against vLLM (admin key only).

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "team-a/sql-v3"}
    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "run-7/step-400",
                                   "load_inplace": true}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

`lora_path` names a folder inside one of the adapter import roots (settings
`adapter_import_roots`, default `<data_dir>/adapter-imports`), never an arbitrary server path;
its files pass the same intake and validation as an upload, are stored in the adapter store
and registered, so every replica serves the adapter, not only the one that was called.

Owner: loraplex adapters belong to a tenant, vLLM's requests name none. The adapter goes to
the tenant named by the optional `tenant` field (a loraplex extension), else to the tenant
called `operator` (created on first use); a tenant serves it with its own keys under
`lora_name`. With `load_inplace` the folder becomes the name's next version and takes its
default alias at once (old versions beyond `adapter_versions_kept` are collected), as vLLM
replaces an adapter's weights for RL loops. Answers are vLLM's: 200 with a plain-text
"Success: ..." line; errors in OpenAI's shape (400 bad path or adapter, or a name already
loaded without `load_inplace`, as vLLM; 404 unknown name or tenant).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from loraplex.platform.adapter_service import (
    publish_version,
    remove_adapter,
    store_and_register,
)
from loraplex.platform.api.deps import AdminDep, StateDep
from loraplex.platform.api.errors import API_ERRORS, APIError
from loraplex.platform.api.routes.adapters import store_unavailable
from loraplex.platform.db import crud
from loraplex.platform.names import AdapterName
from loraplex.platform.store import StoreError
from loraplex.platform.uploads import UploadError, receive_files, upload_workspace
from loraplex.platform.uploads import validate_adapter as validate
from loraplex.platform.uploads.local import folder_parts, resolve_import_folder
from loraplex.platform.uploads.scratch import scratch_unavailable

OPERATOR_TENANT = "operator"

router = APIRouter(prefix="/v1", tags=["admin"], dependencies=[AdminDep], responses=API_ERRORS)
_TEXT = {200: {"content": {"text/plain": {}}, "description": "Success: ..."}}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: AdapterName = Field(description="the name tenants serve it under")
    lora_path: str = Field(description="a folder inside an adapter import root")
    tenant: str | None = Field(None, description=f"owner (loraplex); default {OPERATOR_TENANT!r}")
    load_inplace: bool = Field(
        False,
        description="replace the weights of an existing `lora_name` (vLLM's flag for RL "
        "loops): a new version that takes the default alias at once",
    )


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = Field(None, description="accepted for vLLM clients; unused")
    tenant: str | None = None


def _owner_id(state, name: str | None) -> int:
    """The named tenant's id, or the `operator` tenant's (made on first use)."""
    with state.sessions() as session:
        tenant = crud.get_tenant_by_name(session, name=name or OPERATOR_TENANT)
        if tenant is None and name is None:
            try:
                tenant = crud.create_tenant(session, name=OPERATOR_TENANT)
            except crud.Conflict:  # another replica or request made it meanwhile
                tenant = crud.get_tenant_by_name(session, name=OPERATOR_TENANT)
        if tenant is None:
            raise APIError(404, f"no tenant named '{name or OPERATOR_TENANT}'", "tenant_not_found")
        return tenant.id


def _load(state, body: LoadLoRAAdapterRequest):
    settings = state.settings
    roots = settings.adapter_import_roots
    folder = resolve_import_folder(body.lora_path, roots)  # before any registry write
    tenant_id = _owner_id(state, body.tenant)
    limit = settings.max_upload_bytes
    max_rank = state.engine.config.max_lora_rank if state.engine else settings.max_lora_rank
    with state.sessions() as session:
        quota = crud.get_quota(session, tenant_id=tenant_id)
    if quota is not None and quota.max_adapter_bytes is not None:
        limit = min(limit, quota.max_adapter_bytes)
    if quota is not None and quota.max_rank is not None:
        max_rank = min(max_rank, quota.max_rank)
    tmp_root = settings.data_dir / "tmp"
    with upload_workspace(tmp_root) as ws, folder_parts(folder, roots) as parts:
        copy = receive_files(parts, ws, max_bytes=limit)
        info = validate(
            copy, state.spec, max_rank=max_rank, base_model_name=state.model_name,
            max_bytes=limit, max_weight=settings.max_adapter_weight,
        )  # fmt: skip
        if body.load_inplace:
            keep = settings.adapter_versions_kept
            return publish_version(state, tenant_id, body.lora_name, copy, info, keep=keep)
        with state.sessions() as session:
            if crud.get_adapter(session, tenant_id=tenant_id, name=body.lora_name) is not None:
                # vLLM answers a second load of a name this way; load_inplace replaces it.
                raise APIError(
                    400,
                    f"The lora adapter '{body.lora_name}' has already been loaded. If you "
                    "want to load the adapter in place, set 'load_inplace' to True.",
                    "adapter_exists",
                    "lora_name",
                )
        return store_and_register(state, tenant_id, body.lora_name, copy, info)


@router.post("/load_lora_adapter", response_class=Response, responses=_TEXT)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: StateDep):
    """Register the PEFT folder at `lora_path` (inside an import root) as `lora_name`."""
    if body.lora_name == state.model_name:
        raise APIError(400, f"'{body.lora_name}' is the base model's name", "invalid_name")
    try:
        await asyncio.to_thread(_load, state, body)
    except UploadError as e:
        state.metrics.uploads.labels("refused").inc()
        raise APIError(e.status_code, e.message, e.code, "lora_path") from None
    except StoreError as e:
        state.metrics.uploads.labels("refused").inc()
        raise store_unavailable(body.tenant or OPERATOR_TENANT, body.lora_name, e) from None
    except OSError as e:  # the stores wrap their own: this is the scratch folder's disk
        state.metrics.uploads.labels("refused").inc()
        raise scratch_unavailable(body.tenant or OPERATOR_TENANT, body.lora_name, e) from None
    state.metrics.uploads.labels("ok").inc()
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/unload_lora_adapter", response_class=Response, responses=_TEXT)
def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: StateDep):
    """Delete the adapter `lora_name` of the owner (as DELETE /v1/adapters/{name} does)."""
    with state.sessions() as session:
        tenant = crud.get_tenant_by_name(session, name=body.tenant or OPERATOR_TENANT)
        if tenant is None and body.tenant is not None:
            raise APIError(404, f"no tenant named '{body.tenant}'", "tenant_not_found")
        if tenant is None or not remove_adapter(
            state, session, tenant_id=tenant.id, name=body.lora_name
        ):
            raise APIError(
                404, f"The lora adapter '{body.lora_name}' cannot be found.", "adapter_not_found"
            )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
