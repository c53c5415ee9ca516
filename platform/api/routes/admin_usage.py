"""Admin usage reports and billing exports (included by `admin.py`, under its admin check).

Periods are `start`/`end` query parameters in ISO 8601 (see `loraplex.platform.periods`),
half-open in UTC and the current month by default.
"""

from __future__ import annotations

import json
import socket
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sqlalchemy.orm import Session

from loraplex.platform import usage
from loraplex.platform.api.deps import SessionDep, StateDep
from loraplex.platform.api.errors import APIError
from loraplex.platform.db import crud
from loraplex.platform.db.models import utcnow
from loraplex.platform.guardrails import audit as guardrail_audit
from loraplex.platform.latency_stats import LatencyStats, latency_stats
from loraplex.platform.periods import last_day, period
from loraplex.platform.replicas import STALE_BEATS, fleet, replica_id, snapshot
from loraplex.platform.usage import BillingRow, GroupBy, UsageSummary

router = APIRouter()


class UsageReport(BaseModel):
    object: Literal["list"] = "list"
    period_start: datetime
    period_end: datetime  # exclusive
    group_by: GroupBy
    data: list[UsageSummary]


class BillingReport(BaseModel):
    object: Literal["list"] = "list"
    period_start: datetime
    period_end: datetime  # exclusive
    total_cost: Decimal  # as a string in JSON, like every amount: exact, unlike a float
    data: list[BillingRow]


def _period(start: str | None, end: str | None) -> tuple[datetime, datetime]:
    try:
        return period(start, end)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_period") from None


def _check_tenant(session: Session, tenant_id: int | None) -> None:
    if tenant_id is not None and crud.get_tenant(session, tenant_id=tenant_id) is None:
        raise APIError(404, f"no tenant with id {tenant_id}", "tenant_not_found", "tenant_id")


@router.get("/usage")
def usage_report(
    session: SessionDep,
    start: str | None = None,
    end: str | None = None,
    group_by: GroupBy = "tenant",
    tenant_id: int | None = None,
) -> UsageReport:
    """Requests and tokens per tenant, per (tenant, adapter) or per UTC day."""
    lo, hi = _period(start, end)
    _check_tenant(session, tenant_id)
    rows = usage.usage_summary(session, start=lo, end=hi, group_by=group_by, tenant_id=tenant_id)
    return UsageReport(period_start=lo, period_end=hi, group_by=group_by, data=rows)


@router.get(
    "/billing",
    response_model=None,
    responses={
        200: {
            "model": BillingReport,
            "content": {"text/csv": {}},
            "description": "JSON, or a CSV download with `format=csv`",
        }
    },
)
def billing(
    session: SessionDep,
    start: str | None = None,
    end: str | None = None,
    fmt: Annotated[Literal["json", "csv"], Query(alias="format")] = "json",
    tenant_id: int | None = None,
    by: usage.BillingBy = "tenant",
) -> Response:
    """Tokens and cost per tenant (or, `by=version`, per tenant, adapter and the adapter
    version that answered) at each tenant's current prices (per 1k tokens)."""
    lo, hi = _period(start, end)
    _check_tenant(session, tenant_id)
    rows = usage.billing_export(session, start=lo, end=hi, by=by)
    if tenant_id is not None:
        rows = [r for r in rows if r.tenant_id == tenant_id]
    if fmt == "csv":
        filename = f"loraplex-billing-{lo.date()}_{last_day(hi)}.csv"
        return Response(
            usage.to_csv(rows),
            media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )
    total = sum((r.cost for r in rows), Decimal(0))
    report = BillingReport(period_start=lo, period_end=hi, total_cost=total, data=[])
    # The rows go through the ledger's own serializer, so this JSON and `loraplex usage export
    # --format json` always agree to the character.
    body = report.model_dump(mode="json") | {"data": json.loads(usage.to_json(rows))}
    # Blocks, redactions, flags and fail-opens per tenant (platform/guardrails/audit.py).
    found = guardrail_audit.counts(session, start=lo, end=hi, tenant_id=tenant_id)
    body["guardrail_counts"] = [{"tenant_id": t, **c} for t, c in sorted(found.items())]
    return JSONResponse(body)


# Overview windows: their length and the bucket of their latency series (about 60 points).
WINDOWS = {
    "1h": (3600, 60),
    "6h": (6 * 3600, 360),
    "24h": (86400, 1800),
    "7d": (7 * 86400, 3 * 3600),
}


def _stats(s: LatencyStats) -> dict:
    return {
        "requests": s.requests,
        "errors": s.errors,
        "aborted": s.aborted,
        "ttft_p50_ms": s.ttft_p50,
        "ttft_p99_ms": s.ttft_p99,
        "tpot_p50_ms": s.tpot_p50,
        "tpot_p99_ms": s.tpot_p99,
        "queue_p99_ms": s.queue_p99,
    }


@router.get("/latency")
def latency(
    session: SessionDep,
    window: Literal["1h", "6h", "24h", "7d"] = "1h",
    tenant_id: int | None = None,
    adapter: Annotated[str | None, Query(max_length=128)] = None,
) -> dict:
    """p50/p99 TTFT and TPOT over the last `window` from the usage ledger (every replica),
    per time bucket for all requests, one tenant, or one adapter name (`adapter=` empty:
    the base model); and per tenant: requests, errors, p99 TTFT now and in the window before
    (which tenant's p99 rose), and quota refusals (429) counted by the replica that answered."""
    length, bucket = WINDOWS[window]
    _check_tenant(session, tenant_id)
    end = utcnow()
    start = end - timedelta(seconds=length)
    chosen = dict(tenant_id=tenant_id, adapter=adapter or None, base_model=adapter == "")
    series = latency_stats(session, start=start, end=end, by="time", bucket_s=bucket, **chosen)
    now = {s.key: s for s in latency_stats(session, start=start, end=end, by="tenant")}
    before = {
        s.key: s
        for s in latency_stats(
            session, start=start - timedelta(seconds=length), end=start, by="tenant"
        )
    }
    refused = usage.refusals_since(start)
    names = {t.id: t.name for t in crud.list_tenants(session)}
    tenants = []
    for tid in sorted(set(now) | set(refused), key=lambda t: names.get(t, "")):
        s = now.get(tid) or LatencyStats(tid, 0, 0, 0, None, None, None, None, None)
        asked = s.requests + refused.get(tid, 0)
        tenants.append(
            {
                "tenant_id": tid,
                "tenant": names.get(tid, str(tid)),
                **_stats(s),
                "refused": refused.get(tid, 0),
                "error_rate": s.errors / s.requests if s.requests else None,
                "refused_rate": refused.get(tid, 0) / asked if asked else None,
                "ttft_p99_before_ms": before[tid].ttft_p99 if tid in before else None,
            }
        )
    return {
        "window": window,
        "bucket_s": bucket,
        "start": start.isoformat(),
        "end": end.isoformat(),
        "series": [{"t": s.key.isoformat(), **_stats(s)} for s in series],
        # What `adapter` may name here: the adapters with requests in the window.
        "adapters": usage.adapter_names(session, start=start, end=end, tenant_id=tenant_id),
        "tenants": tenants,
    }


# ---------------------------------------------------------------- live engine state (overview)
def _served(engine_name: str, tenants: dict[int, str]) -> dict:
    """An engine adapter name, `<tenant id>/<adapter>` (with `@v<version>` where versions are
    kept), as the tenant and the name it serves the adapter under."""
    owner, _, served = engine_name.partition("/")
    tenant_id = int(owner) if served and owner.isdigit() else None
    return {
        "adapter": served if tenant_id is not None else engine_name,
        "tenant_id": tenant_id,
        "tenant": tenants.get(tenant_id, owner) if tenant_id is not None else None,
    }


@router.get("/adapter-loads")
def adapter_loads(state: StateDep, session: SessionDep) -> dict:
    """The adapters with the most cold loads (requests whose adapter was not in a device
    slot when they arrived: in host memory or on disk) and their load times, on the replica
    that answered since its engine started; and every adapter request's wait by tier. From
    the engine's own counts (its stats snapshot), so nothing here touches the ledger."""
    body: dict = {"replica": socket.gethostname(), "ready": state.engine is not None,
                  "tiers": {}, "data": []}  # fmt: skip
    if state.engine is None:
        return body
    s = state.engine.stats()
    for tier, counts in s.adapter_load_buckets.items():
        n, total = sum(counts), s.adapter_load_sum.get(tier, 0.0)
        body["tiers"][tier] = {"requests": n, "mean_ms": 1000 * total / n if n else None}
    tenants = {t.id: t.name for t in crud.list_tenants(session)}
    body["data"] = [
        {
            **_served(row["adapter"], tenants),
            "cold_loads": row["loads"],
            "from_disk": row["from_disk"],
            "from_host": row["loads"] - row["from_disk"],
            "mean_ms": 1000 * row["seconds"] / row["loads"],
            "max_ms": 1000 * row["max_seconds"],
        }
        for row in s.cold_adapters
    ]
    return body


@router.get("/replicas")
def replicas(state: StateDep, session: SessionDep) -> dict:
    """Each replica's live engine state: running and waiting requests, KV cache use, the
    adapters in its device slots, and when the state was read.

    The replica that answered reads its own engine now (`this`, first); the others come from
    their heartbeat rows (`platform/replicas.py`), `seen_s_ago` seconds old and `stale` after
    3 missed beats. `shared` says whether the list can hold other replicas: always on
    PostgreSQL, on SQLite when another process beats into the same file. With the heartbeat
    off (`replica_heartbeat_s` 0) the list holds the replica that answered alone."""
    now = utcnow()
    settings = state.settings
    tenants = {t.id: t.name for t in crud.list_tenants(session)}

    def shown(row: dict, **extra) -> dict:
        names = row.get("resident_adapters")
        if names is not None:
            row = row | {"resident_adapters": [_served(n, tenants) for n in names]}
        return row | extra

    this = replica_id(settings)
    rows = [shown(snapshot(state.engine), id=this, this=True, stale=False, seen_s_ago=0.0,
                  updated_at=now.isoformat())]  # fmt: skip
    beat_s = settings.replica_heartbeat_s
    if beat_s <= 0:
        return {"shared": False, "heartbeat_s": 0.0, "data": rows}
    others = [r for r in fleet(session, stale_after_s=STALE_BEATS * beat_s, now=now)
              if r["id"] != this]  # fmt: skip
    rows += [
        shown(
            r["state"],
            id=r["id"],
            this=False,
            stale=r["stale"],
            seen_s_ago=r["seen_s_ago"],
            updated_at=r["seen_at"].isoformat(),
        )
        for r in others
    ]
    shared = bool(others) or session.get_bind().dialect.name != "sqlite"
    return {"shared": shared, "heartbeat_s": beat_s, "data": rows}
