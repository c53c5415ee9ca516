"""Admin API (admin key only): tenants, keys, quotas, all adapters, usage, billing."""

from __future__ import annotations

from fastapi import APIRouter

from loraplex.platform.api.deps import AdminDep

router = APIRouter(prefix="/admin/api", tags=["admin"], dependencies=[AdminDep])
