"""Adapters in the registry and the store, for every route that changes them (a tenant's upload
and delete, the admin's, vLLM's load/unload endpoints): stored and registered together or not
at all, and an object removed once no adapter shares it."""

from __future__ import annotations

import logging

from loraplex.platform import quotas
from loraplex.platform.db import crud
from loraplex.platform.db.models import AdapterStatus
from loraplex.platform.errors import APIError
from loraplex.platform.store import StoreError

log = logging.getLogger("loraplex.platform")


def store_and_register(state, tenant_id: int, name: str, folder, info):
    """Store a validated adapter folder and mark it ready for the tenant (nothing half-done)."""
    with state.sessions() as session:
        if crud.get_adapter(session, tenant_id=tenant_id, name=name) is not None:
            raise APIError(
                409,
                f"an adapter named '{name}' already exists; delete it first",
                "adapter_exists",
                "name",
            )
        decision = quotas.check_adapter_quota(session, tenant_id, rank=info.rank, bytes=info.nbytes)
        if not decision.allowed:
            raise APIError(403, decision.reason or "adapter quota exceeded", "quota_exceeded")
        key = state.store.put(folder, info.digest)
        try:
            return crud.create_adapter(
                session,
                tenant_id=tenant_id,
                name=name,
                base_model=state.model_name,
                rank=info.rank,
                alpha=info.alpha,
                targets=list(info.targets),
                bytes=info.nbytes,
                sha256=info.digest,
                storage_key=key,
                status=AdapterStatus.ready,
            )
        except Exception as e:
            session.rollback()
            # Nothing half-written: the object goes unless another adapter shares it.
            release_object(state, session, info.digest, key)
            if isinstance(e, crud.Conflict):
                raise APIError(409, str(e), "adapter_exists", "name") from None
            raise


def release_object(state, session, digest: str, key: str) -> None:
    """Delete a stored object once no adapter row (of any tenant) shares its content."""
    if crud.count_adapters_with_sha256(session, sha256=digest) == 0:
        try:
            state.store.delete(key)
        except StoreError as e:  # the adapter is gone from the registry; only bytes are left
            log.warning("stored object %s could not be removed: %s", key, e)


def remove_adapter(state, session, *, tenant_id: int, name: str) -> bool:
    """Delete the tenant's adapter row and its object; False when it has no such adapter."""
    row = crud.get_adapter(session, tenant_id=tenant_id, name=name, include_deleted=True)
    if row is None:
        return False
    digest, key = row.sha256, row.storage_key
    crud.delete_adapter(session, tenant_id=tenant_id, name=name)
    release_object(state, session, digest, key)
    return True
