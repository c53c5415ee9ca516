"""Adapters in the registry and the store, for every route that changes them (a tenant's upload
and delete, the admin's, vLLM's load/unload endpoints): stored and registered together or not
at all, and each adapter's object removed with it.

Why no interleaving loses an object: every upload stores its files under a key of its own
(`store.put` makes a fresh key each time, see platform/store/base.py), so an object is named by
at most one row, ever. Deleting a row and then its object cannot touch anything another row
uses, whatever runs at the same time, in this process or on another replica. What a crash can
leave is an object no row names (stored, then the process died before its row was written, or
after the row went and before the object did); `collect_unreferenced` removes those once they
are older than a grace period, which covers the moment between an upload's put and its row.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.platform import quotas
from loraplex.platform.db import crud
from loraplex.platform.db.models import AdapterStatus
from loraplex.platform.errors import APIError
from loraplex.platform.store import AdapterStore, StoreError, make_store

log = logging.getLogger("loraplex.platform")


def store_for(settings) -> AdapterStore:
    """The adapter store the settings name (the server's and the CLI's)."""
    secret = settings.aws_secret_access_key
    return make_store(
        settings.store_url,
        endpoint_url=settings.s3_endpoint_url,
        region=settings.s3_region,
        access_key=settings.aws_access_key_id,
        secret_key=secret.get_secret_value() if secret else None,
    )


def store_and_register(state, tenant_id: int, name: str, folder, info, *, promote: bool = False):
    """Store a validated adapter folder as a new version of `name` for the tenant (nothing
    half-done). The first version of a name gets the default alias; with `promote` a later one
    takes it over in the same transaction."""
    if state.settings.data_plane == "vllm":  # what vLLM cannot serve: refused now, by name
        from loraplex.platform.dataplane.agent import refusal

        if (why := refusal(Path(folder))) is not None:
            raise APIError(422, why, "unsupported_by_data_plane")
    with state.sessions() as session:
        new_name = crud.get_adapter(session, tenant_id=tenant_id, name=name) is None
        decision = quotas.check_adapter_quota(
            session, tenant_id, rank=info.rank, bytes=info.nbytes, new_name=new_name
        )
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
                promote=promote,
            )
        except Exception as e:
            session.rollback()
            # Nothing half-written: the object is ours alone, so it goes at once.
            release_object(state, session, key)
            if isinstance(e, crud.Conflict):
                raise APIError(409, str(e), "adapter_exists", "name") from None
            raise


def publish_version(state, tenant_id: int, name: str, folder, info, *, keep: int):
    """An in-place update (training loops): store the weights as a new version, move the
    default alias to it atomically, then collect the name's versions beyond the newest `keep`
    that no alias uses. A request resolved before the move finishes on the version it
    started on (its files are in this replica's cache, the engine keys them by digest)."""
    row = store_and_register(state, tenant_id, name, folder, info, promote=True)
    with state.sessions() as session:
        for version in crud.old_versions(session, tenant_id=tenant_id, name=name, keep=keep):
            remove_version(state, session, tenant_id=tenant_id, name=name, version=version)
    return row


def release_object(state, session, key: str) -> None:
    """Delete a stored object unless a row still names it (only rows registered before keys
    were made per put share one; their count can only fall)."""
    if crud.count_adapters_with_storage_key(session, storage_key=key) == 0:
        try:
            state.store.delete(key)
        except StoreError as e:  # the adapter is gone from the registry; the collector retries
            log.warning("stored object %s could not be removed: %s", key, e)


def remove_adapter(state, session, *, tenant_id: int, name: str) -> bool:
    """Delete every version of the tenant's adapter, its aliases and its objects; False when
    it has no such adapter."""
    try:
        rows = crud.delete_adapter(session, tenant_id=tenant_id, name=name)
    except crud.NotFound:
        return False
    for row in rows:
        if row.storage_key:  # a deleted version's tombstone names no object
            release_object(state, session, row.storage_key)
    return True


def remove_version(state, session, *, tenant_id: int, name: str, version: int) -> bool:
    """Delete one version and its object; False when there is no such version, crud.InUse
    while an alias sends it traffic."""
    try:
        key = crud.delete_adapter_version(session, tenant_id=tenant_id, name=name, version=version)
    except crud.NotFound:
        return False
    release_object(state, session, key)
    return True


@dataclass
class Collected:
    removed: list[str] = field(default_factory=list)  # keys of the objects deleted
    kept_young: int = 0  # unreferenced, but younger than the grace period
    referenced: int = 0


def collect_unreferenced(state, *, grace_s: float, now: float | None = None) -> Collected:
    """Delete stored objects that no adapter row names and that are older than `grace_s`.

    Safe beside uploads, deletes and other collectors on any replica: a key is never named by
    a row again once it is not, except for an upload between its put and its row, which the
    grace period protects (the object is listed before the rows are read, so a row written
    after the read belongs to an object that was fresh when listed).
    """
    report = Collected()
    objects = list(state.store.list_objects())
    with state.sessions() as session:
        named = crud.storage_keys(session)
    now = time.time() if now is None else now
    for obj in objects:
        if obj.key in named:
            report.referenced += 1
        elif now - obj.modified < grace_s:
            report.kept_young += 1
        else:
            try:
                state.store.delete(obj.key)
            except StoreError as e:
                log.warning("unreferenced object %s could not be removed: %s", obj.key, e)
                continue
            report.removed.append(obj.key)
    if report.removed:
        log.info("removed %d stored objects no adapter names", len(report.removed))
    return report


async def collect_periodically(state, *, interval_s: float, grace_s: float) -> None:
    """The server's collector: at start, then every `interval_s` (each replica runs one; they
    may overlap, as deleting an object twice is not an error)."""
    while True:
        try:
            await asyncio.to_thread(collect_unreferenced, state, grace_s=grace_s)
        except Exception as e:  # a store outage must not stop the server, nor this loop
            log.warning("collecting unreferenced adapter objects failed: %s", e)
        await asyncio.sleep(interval_s)
