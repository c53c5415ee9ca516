"""Per-tenant prefix-cache salts (issue 56; docs/kv-tiers.md).

Every request of a tenant carries the tenant's salt into the engine (`SamplingParams.cache_salt`,
set by the serving path from the authenticated tenant row), where it enters the first block's
key of the prefix cache: device hits and KV tier keys are found only under the salt they were
stored with. Rotating the salt therefore makes everything cached for the tenant unreachable at
once, on every replica (each request reads the tenant row as it authenticates), and leaves
other tenants' entries as they are. The unreachable blocks are collected as any other: the
device pool's LRU, host and disk LRU bounds, the shared store's TTL.

A tenant's salt is null until its first rotation: its requests are then keyed by tenant id
alone (the key carries the tenant either way, so tenants never share entries).
"""

from __future__ import annotations

import secrets

from sqlalchemy import update
from sqlalchemy.orm import Session

from loraplex.platform.db.models import Tenant


def new_salt() -> str:
    return secrets.token_hex(32)  # 64 characters: tenants.cache_salt's width


def rotate(session: Session, tenant_id: int) -> bool:
    """Give the tenant a new salt (committed); whether the tenant exists."""
    done = session.execute(
        update(Tenant).where(Tenant.id == tenant_id).values(cache_salt=new_salt())
    )
    session.commit()
    return done.rowcount == 1


def salt_of(tenant: Tenant) -> str | None:
    """The salt a request of `tenant` carries into the engine (None: never rotated)."""
    return tenant.cache_salt
