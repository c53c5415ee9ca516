"""Registry operations the API and the CLI call: tenants, quotas, API keys, adapters.

Every function takes the session first and everything else by keyword, validates its input
through `schemas` (a pydantic `ValidationError` is a `ValueError`), and commits its own
change. Adapter lookups always take the tenant: a tenant can only ever reach its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import NamedTuple

from sqlalchemy import delete, func, inspect, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.platform.db.models import (
    Adapter,
    AdapterAlias,
    AdapterStatus,
    ApiKey,
    Quota,
    Tenant,
    TenantStatus,
    utcnow,
)
from loraplex.platform.db.schemas import (
    AdapterCreate,
    ApiKeyCreate,
    ApiKeyPublic,
    QuotaBase,
    TenantCreate,
    TenantUpdate,
)
from loraplex.platform.security import KEY_PREFIX, constant_time_equals, hash_key, new_api_key

# last_used_at is for humans ("is this key still in use?"); writing it on every request
# would turn each read-only request into a write on the key's row.
LAST_USED_RESOLUTION = timedelta(minutes=1)


class NotFound(LookupError):
    """The row does not exist (or belongs to another tenant, which callers cannot tell)."""


class Conflict(ValueError):
    """A unique name is already taken."""


# --- tenants -------------------------------------------------------------------------------


def create_tenant(
    session: Session,
    *,
    name: str,
    weight: float = 1.0,
    price_prompt_per_1k: Decimal | int | str = 0,
    price_completion_per_1k: Decimal | int | str = 0,
) -> Tenant:
    """A new active tenant; prices are per 1000 tokens (Decimal or a decimal string)."""
    data = TenantCreate(
        name=name,
        weight=weight,
        price_prompt_per_1k=price_prompt_per_1k,  # pydantic parses strings to exact Decimals
        price_completion_per_1k=price_completion_per_1k,
    )
    tenant = Tenant(**data.model_dump())
    session.add(tenant)
    try:
        session.commit()
    except IntegrityError as e:
        session.rollback()
        raise Conflict(f"a tenant named {data.name!r} already exists") from e
    return tenant


def get_tenant(session: Session, *, tenant_id: int) -> Tenant | None:
    return session.get(Tenant, tenant_id)


def get_tenant_by_name(session: Session, *, name: str) -> Tenant | None:
    return session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()


def list_tenants(session: Session, *, status: TenantStatus | None = None) -> list[Tenant]:
    query = select(Tenant).order_by(Tenant.name)
    if status is not None:
        query = query.where(Tenant.status == status)
    return list(session.scalars(query))


def update_tenant(
    session: Session,
    *,
    tenant_id: int,
    weight: float | None = None,
    price_prompt_per_1k: Decimal | int | str | None = None,
    price_completion_per_1k: Decimal | int | str | None = None,
    status: TenantStatus | str | None = None,
) -> Tenant:
    """Change the given fields; None leaves a field as it is."""
    data = TenantUpdate(
        weight=weight,
        price_prompt_per_1k=price_prompt_per_1k,
        price_completion_per_1k=price_completion_per_1k,
        status=status,
    )
    tenant = _tenant_or_raise(session, tenant_id)
    for field, value in data.model_dump(exclude_none=True).items():
        setattr(tenant, field, value)
    session.commit()
    return tenant


def _tenant_or_raise(session: Session, tenant_id: int) -> Tenant:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFound(f"no tenant with id {tenant_id}")
    return tenant


# --- quotas --------------------------------------------------------------------------------


def set_quota(
    session: Session,
    *,
    tenant_id: int,
    requests_per_min: int | None = None,
    tokens_per_min: int | None = None,
    tokens_per_month: int | None = None,
    max_adapters: int | None = None,
    max_adapter_bytes: int | None = None,
    max_rank: int | None = None,
    batch_tokens_per_month: int | None = None,
) -> Quota:
    """Replace all the tenant's limits at once; a limit left None is unlimited."""
    data = QuotaBase(
        requests_per_min=requests_per_min,
        tokens_per_min=tokens_per_min,
        tokens_per_month=tokens_per_month,
        max_adapters=max_adapters,
        max_adapter_bytes=max_adapter_bytes,
        max_rank=max_rank,
        batch_tokens_per_month=batch_tokens_per_month,
    )
    _tenant_or_raise(session, tenant_id)
    quota = session.get(Quota, tenant_id) or Quota(tenant_id=tenant_id)
    for field, value in data.model_dump().items():
        setattr(quota, field, value)
    session.add(quota)
    session.commit()
    return quota


def get_quota(session: Session, *, tenant_id: int) -> Quota | None:
    """The tenant's limits; None when it has none (unlimited)."""
    return session.get(Quota, tenant_id)


# --- API keys ------------------------------------------------------------------------------


def create_key(
    session: Session, *, tenant_id: int, name: str = "default", expires_at: datetime | None = None
) -> tuple[str, ApiKey]:
    """A new key for the tenant: (the secret, to show exactly once; the stored row)."""
    data = ApiKeyCreate(name=name, expires_at=expires_at)
    _tenant_or_raise(session, tenant_id)
    secret, prefix, digest = new_api_key()
    key = ApiKey(
        tenant_id=tenant_id,
        name=data.name,
        prefix=prefix,
        key_hash=digest,
        expires_at=data.expires_at,
    )
    session.add(key)
    session.commit()
    return secret, key


def authenticate(
    session: Session, secret: str, *, now: datetime | None = None
) -> tuple[Tenant, ApiKey] | None:
    """The tenant and key a bearer secret belongs to, or None for unknown, revoked or expired
    keys and suspended tenants (callers answer all of these alike, so nothing leaks)."""
    if not secret.startswith(KEY_PREFIX):
        return None
    digest = hash_key(secret)
    row = session.execute(
        select(ApiKey, Tenant).join(Tenant).where(ApiKey.key_hash == digest)
    ).first()
    if row is None:
        return None
    key, tenant = row
    now = now or utcnow()
    if (
        not constant_time_equals(key.key_hash, digest)
        or key.revoked_at is not None
        or (key.expires_at is not None and key.expires_at <= now)
        or tenant.status != TenantStatus.active
    ):
        return None
    if key.last_used_at is None or now - key.last_used_at >= LAST_USED_RESOLUTION:
        key.last_used_at = now
        session.commit()
    return tenant, key


def revoke_key(
    session: Session, *, key_id: int, tenant_id: int | None = None, now: datetime | None = None
) -> ApiKey:
    """Revoke a key (idempotent). With `tenant_id`, another tenant's key is NotFound."""
    key = session.get(ApiKey, key_id)
    if key is None or (tenant_id is not None and key.tenant_id != tenant_id):
        raise NotFound(f"no API key with id {key_id}")
    if key.revoked_at is None:
        key.revoked_at = now or utcnow()
        session.commit()
    return key


def list_keys(session: Session, *, tenant_id: int) -> list[ApiKeyPublic]:
    """The tenant's keys, revoked ones included, as public views (no hash)."""
    keys = session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.id))
    return [ApiKeyPublic.model_validate(key) for key in keys]


# --- adapters ------------------------------------------------------------------------------


class AdapterTotals(NamedTuple):
    count: int
    bytes: int


DEFAULT_ALIAS = "default"  # the alias a request naming just the adapter follows


class InUse(Conflict):
    """The row is still needed (a version an alias sends traffic to)."""


def _version_weights(weights: dict) -> dict[str, int]:
    return {str(int(v)): int(w) for v, w in weights.items()}


def create_adapter(
    session: Session,
    *,
    tenant_id: int,
    name: str,
    base_model: str,
    rank: int,
    alpha: float,
    targets: Sequence[str] | str,
    bytes: int,
    sha256: str,
    storage_key: str,
    status: AdapterStatus | str = AdapterStatus.ready,
    version: int | None = None,
    promote: bool = False,
) -> Adapter:
    """Register a validated, stored adapter as a new version of `name`, in one transaction.

    Without `version` it becomes the name's next version (two uploads racing for one number:
    the loser retries with the next). The first version of a name also creates the name's
    default alias pointing at it; with `promote` a later version takes the default alias too,
    atomically with its row (the previous target is kept for a rollback). `targets` is a list
    of module names or a comma-separated string. Raises Conflict when an explicit version is
    taken, NotFound for an unknown tenant.
    """
    data = AdapterCreate(
        name=name,
        base_model=base_model,
        rank=rank,
        alpha=alpha,
        targets=targets.split(",") if isinstance(targets, str) else list(targets),
        bytes=bytes,
        sha256=sha256,
        storage_key=storage_key,
        status=status,
    )
    _tenant_or_raise(session, tenant_id)
    for _ in range(8):
        _lock_versions(session, tenant_id, data.name)
        number = version or 1 + (
            session.scalar(
                select(func.max(Adapter.version)).where(
                    Adapter.tenant_id == tenant_id, Adapter.name == data.name
                )
            )
            or 0
        )
        alias = get_alias(session, tenant_id=tenant_id, name=data.name, alias=DEFAULT_ALIAS)
        adapter = Adapter(tenant_id=tenant_id, version=number, **data.model_dump())
        session.add(adapter)
        if alias is None:
            session.add(
                AdapterAlias(
                    tenant_id=tenant_id,
                    name=data.name,
                    alias=DEFAULT_ALIAS,
                    weights={str(number): 100},
                )
            )
        elif promote:
            alias.previous, alias.weights = alias.weights, {str(number): 100}
            alias.updated_at = utcnow()
        try:
            session.commit()
            return adapter
        except IntegrityError as e:
            session.rollback()
            if version is not None:
                raise Conflict(f"adapter {data.name!r} already has a version {version}") from e
    raise Conflict(f"adapter {data.name!r}: too many concurrent uploads; retry")


def get_adapter(
    session: Session,
    *,
    tenant_id: int,
    name: str,
    version: int | None = None,
    include_deleted: bool = False,
) -> Adapter | None:
    """One version of the tenant's adapter `name`; without `version`, its newest."""
    query = select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name)
    if version is not None:
        query = query.where(Adapter.version == version)
    if not include_deleted:
        query = query.where(Adapter.status != AdapterStatus.deleted)
    return session.scalars(query.order_by(Adapter.version.desc()).limit(1)).one_or_none()


def list_adapters(
    session: Session,
    *,
    tenant_id: int | None,
    status: AdapterStatus | None = None,
    include_deleted: bool = False,
    name: str | None = None,
) -> list[Adapter]:
    """Every version of one tenant's adapters (or of one name), or every tenant's with
    `tenant_id=None` (admin only); by tenant, name, version."""
    query = select(Adapter).order_by(Adapter.tenant_id, Adapter.name, Adapter.version)
    if tenant_id is not None:
        query = query.where(Adapter.tenant_id == tenant_id)
    if name is not None:
        query = query.where(Adapter.name == name)
    if status is not None:
        query = query.where(Adapter.status == status)
    elif not include_deleted:
        query = query.where(Adapter.status != AdapterStatus.deleted)
    return list(session.scalars(query))


def list_aliases(
    session: Session, *, tenant_id: int | None, name: str | None = None
) -> list[AdapterAlias]:
    query = select(AdapterAlias).order_by(
        AdapterAlias.tenant_id, AdapterAlias.name, AdapterAlias.alias
    )
    if tenant_id is not None:
        query = query.where(AdapterAlias.tenant_id == tenant_id)
    if name is not None:
        query = query.where(AdapterAlias.name == name)
    return list(session.scalars(query))


def get_alias(session: Session, *, tenant_id: int, name: str, alias: str) -> AdapterAlias | None:
    return session.scalars(
        select(AdapterAlias).where(
            AdapterAlias.tenant_id == tenant_id,
            AdapterAlias.name == name,
            AdapterAlias.alias == alias,
        )
    ).one_or_none()


def _lock_versions(session: Session, tenant_id: int, name: str) -> dict[int, Adapter]:
    """The name's ready version rows, locked until the commit: alias changes, uploads and
    version deletes of one name take the same locks, so neither sees another half-done.
    PostgreSQL locks the rows; SQLite ignores FOR UPDATE, so a write that changes nothing
    takes its database write lock first (reads outside a write transaction would not see a
    writer that commits before this one does)."""
    if session.get_bind().dialect.name == "sqlite":
        session.execute(update(AdapterAlias).where(AdapterAlias.id == -1).values(name=name))
    rows = session.scalars(
        select(Adapter)
        .where(Adapter.tenant_id == tenant_id, Adapter.name == name)
        .with_for_update()
    )
    return {a.version: a for a in rows if a.status == AdapterStatus.ready}


def set_alias(
    session: Session, *, tenant_id: int, name: str, alias: str, weights: dict
) -> AdapterAlias:
    """Point `alias` of `name` at one version ({3: 100}) or split it ({3: 90, 4: 10}), in one
    transaction; the previous target is kept for `rollback_alias`. NotFound when the name or
    a version does not exist."""
    weights = _version_weights(weights)
    if not weights or any(w <= 0 for w in weights.values()):
        raise ValueError("weights: give at least one version, each with a weight above 0")
    versions = _lock_versions(session, tenant_id, name)
    if not versions:
        raise NotFound(f"no adapter named {name!r}")
    missing = sorted(int(v) for v in weights if int(v) not in versions)
    if missing:
        session.rollback()
        raise NotFound(f"adapter {name!r} has no version {', '.join(f'v{v}' for v in missing)}")
    row = get_alias(session, tenant_id=tenant_id, name=name, alias=alias)
    if row is None:
        row = AdapterAlias(tenant_id=tenant_id, name=name, alias=alias, weights=weights)
        session.add(row)
    elif row.weights != weights:
        row.previous, row.weights = row.weights, weights
        row.updated_at = utcnow()
    session.commit()
    return row


def rollback_alias(session: Session, *, tenant_id: int, name: str, alias: str) -> AdapterAlias:
    """Swap the alias back to its previous target (a second rollback undoes the first).
    NotFound without such an alias or with nothing to roll back to; a previous target whose
    version was deleted meanwhile is NotFound too, and nothing changes."""
    versions = _lock_versions(session, tenant_id, name)
    row = get_alias(session, tenant_id=tenant_id, name=name, alias=alias)
    if row is None:
        raise NotFound(f"adapter {name!r} has no alias {alias!r}")
    if not row.previous:
        session.rollback()
        raise NotFound(f"alias {alias!r} of {name!r} has no previous target to roll back to")
    gone = sorted(int(v) for v in row.previous if int(v) not in versions)
    if gone:
        session.rollback()
        listed = ", ".join(f"v{v}" for v in gone)
        raise NotFound(f"cannot roll back {name!r}@{alias}: version {listed} was deleted")
    row.previous, row.weights = row.weights, row.previous
    row.updated_at = utcnow()
    session.commit()
    return row


def delete_alias(session: Session, *, tenant_id: int, name: str, alias: str) -> None:
    if alias == DEFAULT_ALIAS:
        raise InUse("the default alias stays while the adapter exists; delete the adapter")
    gone = session.execute(
        delete(AdapterAlias).where(
            AdapterAlias.tenant_id == tenant_id,
            AdapterAlias.name == name,
            AdapterAlias.alias == alias,
        )
    )
    session.commit()
    if gone.rowcount != 1:
        raise NotFound(f"adapter {name!r} has no alias {alias!r}")


def mark_adapter_deleted(session: Session, *, tenant_id: int, name: str) -> Adapter:
    """Hide the adapter from the tenant and the engine while its stored files are removed."""
    adapter = get_adapter(session, tenant_id=tenant_id, name=name)
    if adapter is None:
        raise NotFound(f"no adapter named {name!r}")
    adapter.status = AdapterStatus.deleted
    session.commit()
    return adapter


def delete_adapter(session: Session, *, tenant_id: int, name: str) -> list[Adapter]:
    """Remove every version of the name and its aliases (frees the name); returns the rows so
    the caller can clean up the store.

    Two deletes racing: one removes the rows, the other gets NotFound (not a stale-row error
    from the ORM), on SQLite and PostgreSQL alike. The name's version lock comes first, as an
    upload takes it: a delete that meets an upload of a new version waits for it and removes
    that version too (the rows are read after the lock, in a statement of their own, so they
    include what the upload committed), where it once left the new version without an alias.
    """
    _lock_versions(session, tenant_id, name)
    rows = list_adapters(session, tenant_id=tenant_id, name=name, include_deleted=True)
    if not rows:
        raise NotFound(f"no adapter named {name!r}")
    for row in rows:
        session.expunge(row)  # stays readable for the caller after the row is gone
    gone = session.execute(delete(Adapter).where(Adapter.id.in_([r.id for r in rows])))
    session.execute(
        delete(AdapterAlias).where(AdapterAlias.tenant_id == tenant_id, AdapterAlias.name == name)
    )
    session.commit()
    if gone.rowcount == 0:
        raise NotFound(f"no adapter named {name!r}")
    return rows


def _referenced_versions(session: Session, tenant_id: int, name: str) -> dict[int, list[str]]:
    """Version -> the aliases that send it traffic."""
    used: dict[int, list[str]] = {}
    for alias in list_aliases(session, tenant_id=tenant_id, name=name):
        for v in alias.weights:
            used.setdefault(int(v), []).append(alias.alias)
    return used


def delete_adapter_version(session: Session, *, tenant_id: int, name: str, version: int) -> str:
    """Remove one version; InUse while an alias sends it traffic (move the alias first).
    Returns the storage key the caller must clean up.

    The row stays as a tombstone (status deleted, no storage key): version numbers come from
    the rows, and a number once given must never name other weights (`name@v2` pinned by a
    client keeps meaning what it meant, or nothing)."""
    versions = _lock_versions(session, tenant_id, name)
    row = versions.get(version)
    if row is None:
        session.rollback()
        raise NotFound(f"adapter {name!r} has no version v{version}")
    aliases = _referenced_versions(session, tenant_id, name).get(version)
    if aliases:
        session.rollback()
        raise InUse(
            f"v{version} of {name!r} is in use by alias {', '.join(sorted(aliases))}: "
            "point the alias elsewhere (or roll it back) first"
        )
    key = row.storage_key
    row.status, row.storage_key = AdapterStatus.deleted, ""
    session.commit()
    return key


def old_versions(session: Session, *, tenant_id: int, name: str, keep: int) -> list[int]:
    """Versions beyond the newest `keep` that no alias sends traffic to (for collection)."""
    used = _referenced_versions(session, tenant_id, name)
    numbers = sorted(
        (a.version for a in list_adapters(session, tenant_id=tenant_id, name=name)),
        reverse=True,
    )
    return [v for v in numbers[max(keep, 0) :] if v not in used]


def count_adapters_with_storage_key(session: Session, *, storage_key: str) -> int:
    """Rows naming a stored object. Keys are made afresh by every put, so once this reaches 0
    it stays 0 (only rows from before per-put keys share one)."""
    return session.scalar(select(func.count()).where(Adapter.storage_key == storage_key)) or 0


def storage_keys(session: Session) -> set[str]:
    """Every stored object some adapter row names, for the collector."""
    return set(session.scalars(select(Adapter.storage_key)))


def adapter_totals(session: Session, *, tenant_id: int) -> AdapterTotals:
    """Adapters (names) of the tenant that occupy storage, and the bytes of all their versions
    (for its quota)."""
    live = (AdapterStatus.uploading, AdapterStatus.ready)
    count, total = session.execute(
        select(
            func.count(func.distinct(Adapter.name)), func.coalesce(func.sum(Adapter.bytes), 0)
        ).where(Adapter.tenant_id == tenant_id, Adapter.status.in_(live))
    ).one()
    return AdapterTotals(int(count), int(total))


def touch_adapter_used(session: Session, *, adapter_id: int, now: datetime | None = None) -> None:
    """Record a use of the adapter, at most one write a minute.

    A request has just read the adapter's row in this session: when that row shows a use
    less than a minute old, nothing is sent to the database, neither a statement nor a commit.
    That is every request but about one a minute per adapter: before, each request ran the
    conditional UPDATE below and a commit (on SQLite, the database's write lock; on
    PostgreSQL, two round trips), matching no row. Otherwise that one conditional UPDATE, so
    replicas that touch the same row at once still write it at most once a minute between
    them. The value is the same as before: the time of a use, at most a minute old."""
    now = now or utcnow()
    row = session.identity_map.get(inspect(Adapter).identity_key_from_primary_key((adapter_id,)))
    if row is not None and "last_used_at" not in inspect(row).unloaded:
        seen = row.last_used_at
        if seen is not None and now - LAST_USED_RESOLUTION < seen <= now:
            return
    session.execute(
        update(Adapter)
        .where(
            Adapter.id == adapter_id,
            or_(Adapter.last_used_at.is_(None), Adapter.last_used_at <= now - LAST_USED_RESOLUTION),
        )
        .values(last_used_at=now)
    )
    session.commit()
