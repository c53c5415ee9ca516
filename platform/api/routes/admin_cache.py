"""Admin API: a tenant's prefix-cache salt (platform/db/cache_salts.py). Included by
`admin.py` under its prefix and admin check."""

from __future__ import annotations

import logging

from fastapi import APIRouter

from loraplex.platform.api.deps import SessionDep
from loraplex.platform.db import cache_salts
from loraplex.platform.errors import APIError

log = logging.getLogger("loraplex.platform")

router = APIRouter(tags=["admin"])


@router.post("/tenants/{tenant_id}/cache-salt/rotate")
def rotate_cache_salt(tenant_id: int, session: SessionDep) -> dict:
    """Give the tenant a new prefix-cache salt: its KV cached so far (every replica's device
    pool and KV tiers) is unreachable from its next request on; other tenants' is kept. The
    salt is a secret: neither this nor any route shows it."""
    if not cache_salts.rotate(session, tenant_id):
        raise APIError(404, f"no tenant with id {tenant_id}", "tenant_not_found", "tenant_id")
    log.info("tenant %d: prefix-cache salt rotated", tenant_id)
    return {"object": "tenant.cache_salt", "tenant_id": tenant_id, "rotated": True}
