"""Registry tables: tenants, API keys, adapters, quotas, usage records, rate counters.

The same models run on SQLite (embedded default) and PostgreSQL (scale-out); alembic's
`migrations/versions` must describe exactly these tables (a test diffs them).
Timestamps are timezone-aware UTC everywhere, also on SQLite, via `UTCDateTime`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Numeric,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Explicit constraint names: migrations can refer to them, and SQLite's batch mode needs them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Prices per 1k tokens: 9 decimals so $0.02 per million tokens is still exact.
PRICE = Numeric(18, 9)
# 64-bit on PostgreSQL; SQLite only autoincrements a column declared exactly INTEGER.
BIGID = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """An aware UTC datetime on every backend (SQLite would hand back naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        # Naive values are taken as UTC; SQLite stores text, which must all be in UTC to sort.
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class TenantStatus(StrEnum):
    active = "active"
    suspended = "suspended"


class AdapterStatus(StrEnum):
    uploading = "uploading"
    ready = "ready"
    failed = "failed"
    deleted = "deleted"


class RequestClass(StrEnum):
    interactive = "interactive"
    batch = "batch"  # a line of a Batch API job: low priority, priced by batch_price_factor


class BatchStatus(StrEnum):  # OpenAI's batch states
    validating = "validating"
    failed = "failed"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


class UsageStatus(StrEnum):
    ok = "ok"
    aborted = "aborted"
    error = "error"
    rejected = "rejected"


def _one_of(column: str, enum: type[StrEnum]) -> CheckConstraint:
    values = ", ".join(f"'{m.value}'" for m in enum)
    return CheckConstraint(f"{column} IN ({values})", name=f"{column}_valid")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), Decimal: PRICE}


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("weight > 0", name="weight_positive"),
        _one_of("status", TenantStatus),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)  # fair-share weight
    price_prompt_per_1k: Mapped[Decimal] = mapped_column(default=Decimal(0))
    price_completion_per_1k: Mapped[Decimal] = mapped_column(default=Decimal(0))
    # Batch API tokens cost this fraction of the prices above (they run on idle capacity).
    batch_price_factor: Mapped[Decimal] = mapped_column(
        Numeric(6, 4), default=Decimal("0.5"), server_default="0.5"
    )
    status: Mapped[str] = mapped_column(String(16), default=TenantStatus.active.value)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The prefix cache's salt for the tenant's requests (SamplingParams.cache_salt), a secret
    # the API never shows: rotating it (platform/db/cache_salts.py) makes the tenant's cached
    # KV unreachable. Null until the first rotation: keys by tenant id alone.
    cache_salt: Mapped[str | None] = mapped_column(String(64), default=None)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    prefix: Mapped[str] = mapped_column(String(16))  # shown in listings, e.g. "lpx_ab12cd34"
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class Adapter(Base):
    """One immutable version of a tenant's adapter: an upload under a name the tenant already
    has adds version n+1 beside the others; requests reach a version through the name's
    aliases (`AdapterAlias`) or pin it as `name@vN`."""

    __tablename__ = "adapters"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", "version"),
        CheckConstraint("rank > 0", name="rank_positive"),
        CheckConstraint("version > 0", name="version_positive"),
        _one_of("status", AdapterStatus),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    # Indexed by the (tenant_id, name) unique constraint's index.
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    base_model: Mapped[str] = mapped_column(String(255))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    targets: Mapped[list[str]] = mapped_column(JSON)  # module names, e.g. ["q_proj", "v_proj"]
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64), index=True)  # the store is keyed by it
    storage_key: Mapped[str] = mapped_column(String(512))
    status: Mapped[str] = mapped_column(String(16), default=AdapterStatus.ready.value)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]


class AdapterAlias(Base):
    """Where a name's alias sends requests: one version, or a weighted split for a canary.

    `weights` maps version numbers (as strings, JSON keys) to positive integer weights;
    `previous` is the mapping before the last change, so a rollback is one atomic swap. The
    alias `default` is what a request naming just the adapter follows.
    """

    __tablename__ = "adapter_aliases"
    __table_args__ = (UniqueConstraint("tenant_id", "name", "alias"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    alias: Mapped[str] = mapped_column(String(64))
    weights: Mapped[dict[str, int]] = mapped_column(JSON)
    previous: Mapped[dict[str, int] | None] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class Quota(Base):
    """Per-tenant limits; NULL means unlimited, and a tenant without a row is unlimited."""

    __tablename__ = "quotas"

    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    requests_per_min: Mapped[int | None] = mapped_column(Integer)
    tokens_per_min: Mapped[int | None] = mapped_column(BigInteger)
    tokens_per_month: Mapped[int | None] = mapped_column(BigInteger)
    max_adapters: Mapped[int | None] = mapped_column(Integer)
    max_adapter_bytes: Mapped[int | None] = mapped_column(BigInteger)  # all adapters together
    max_rank: Mapped[int | None] = mapped_column(Integer)
    # Tokens of Batch API lines in a calendar month, on top of (not instead of) the limits above.
    batch_tokens_per_month: Mapped[int | None] = mapped_column(BigInteger)


class UsageRecord(Base):
    """One row per request, written when it ends, with the tokens actually delivered."""

    __tablename__ = "usage_records"
    __table_args__ = (
        _one_of("status", UsageStatus),
        _one_of("request_class", RequestClass),
        # The monthly budget and per-tenant reports scan one tenant's time range.
        Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(BIGID, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    # No cascade: the ledger outlives keys and must never silently lose billed usage.
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    adapter_name: Mapped[str | None] = mapped_column(String(128))  # None: the base model
    adapter_version: Mapped[int | None] = mapped_column(Integer)  # the version that answered
    model: Mapped[str] = mapped_column(String(255))
    # The request's `user` field: the tenant's own end-user id, for their abuse tracking.
    end_user: Mapped[str | None] = mapped_column(String(256))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)  # part of prompt_tokens
    status: Mapped[str] = mapped_column(String(16))
    request_class: Mapped[str] = mapped_column(
        String(16), default=RequestClass.interactive.value, server_default="interactive"
    )
    # Latencies in milliseconds, None where the request never got that far. ttft_ms and
    # latency_ms (end to end) run from the request's admission (after auth and quota) to its
    # first token and to its end; queue_ms is the engine's wait before the first step that
    # computed the request; tpot_ms the mean time per output token after the first.
    queue_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    tpot_ms: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class RateCounter(Base):
    """Requests and tokens charged to a tenant in one wall-clock minute, shared by replicas."""

    __tablename__ = "rate_counters"

    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    window_start: Mapped[datetime] = mapped_column(primary_key=True)  # second 0 of the minute
    requests: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class QuotaRelease(Base):
    """A reservation given back for a request that never ran (platform/ledger.py): its row
    makes the release happen once, however often the usage journal replays it."""

    __tablename__ = "quota_releases"

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class StoredFile(Base):
    """A tenant's file of the Files API (batch input, batch output and errors); its bytes are
    an object of the adapter store (platform/files.py)."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "file-<hex>"
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(256))
    bytes: Mapped[int] = mapped_column(BigInteger)
    lines: Mapped[int] = mapped_column(Integer, default=0)  # requests, for purpose "batch"
    storage_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Batch(Base):
    """A Batch API job. Its progress is its rows in `batch_lines`; the replica holding it
    (`runner`) renews `lease_until`, and any replica takes over a batch whose lease ran out."""

    __tablename__ = "batches"
    __table_args__ = (_one_of("status", BatchStatus),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "batch_<hex>"
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    input_file_id: Mapped[str] = mapped_column(String(40))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(8))
    meta: Mapped[dict | None] = mapped_column("metadata", JSON)
    status: Mapped[str] = mapped_column(String(16), default=BatchStatus.validating.value)
    errors: Mapped[list | None] = mapped_column(JSON)
    total: Mapped[int] = mapped_column(Integer, default=0)
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    runner: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]


class BatchLine(Base):
    """A finished line of a batch: its output (or error) line, written once. A line without a
    row has not run to its end; the primary key makes a second answer for it a no-op."""

    __tablename__ = "batch_lines"

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    line: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0-based, in the input file
    ok: Mapped[bool]
    result: Mapped[str] = mapped_column(Text)  # the JSON line of the output or error file
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Replica(Base):
    """A server replica's heartbeat: its engine's live state, written every few seconds, so
    that any replica's dashboard shows the whole fleet (a row not renewed is a gone replica)."""

    __tablename__ = "replicas"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # host:port:pid
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    seen_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    state: Mapped[dict] = mapped_column(JSON)  # the engine stats snapshot the overview shows


class GuardrailPolicy(Base):
    """A tenant's input/output policy (platform/guardrails/): deterministic checks (terms,
    regexes, PII kinds) and/or a guard adapter, and what a hit does. A policy with a key
    applies to that key's requests only."""

    __tablename__ = "guardrail_policies"
    __table_args__ = (
        CheckConstraint("stages IN ('input', 'output', 'both')", name="stages_valid"),
        CheckConstraint("action IN ('block', 'redact', 'flag')", name="action_valid"),
        CheckConstraint("fail_mode IN ('open', 'closed')", name="fail_mode_valid"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    stages: Mapped[str] = mapped_column(String(8))
    action: Mapped[str] = mapped_column(String(8))
    terms: Mapped[list] = mapped_column(JSON, default=list)
    patterns: Mapped[list] = mapped_column(JSON, default=list)  # regexes (Python `re`)
    pii: Mapped[list] = mapped_column(JSON, default=list)  # "email", "phone", "card"
    # The guard adapter: an adapter name (or name@vN) of `guard_tenant_id` (the operator's
    # shared one) or, when that is None, of the policy's tenant.
    guard_adapter: Mapped[str | None] = mapped_column(String(160))
    guard_tenant_id: Mapped[int | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="SET NULL")
    )
    guard_threshold: Mapped[float] = mapped_column(Float, default=0.5)
    fail_mode: Mapped[str] = mapped_column(String(8), default="closed")
    record_text: Mapped[bool] = mapped_column(default=False)  # the tenant's opt-in
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class GuardrailEvent(Base):
    """One block, redaction, flag or fail-open of a policy: the audit trail. `text` (the span
    or window that hit) only where the policy records text."""

    __tablename__ = "guardrail_events"
    __table_args__ = (Index("ix_guardrail_events_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(BIGID, primary_key=True)
    # No cascade from tenants: the audit trail outlives keys and policies, as the ledger does.
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    policy_id: Mapped[int | None] = mapped_column(
        ForeignKey("guardrail_policies.id", ondelete="SET NULL")
    )
    policy_name: Mapped[str] = mapped_column(String(64))
    rule: Mapped[str] = mapped_column(String(200))  # "term", "regex:0", "pii:email", "guard:…"
    stage: Mapped[str] = mapped_column(String(8))  # input | output
    action: Mapped[str] = mapped_column(String(16))  # block | redact | flag | fail_open
    request_id: Mapped[str] = mapped_column(String(80))
    route: Mapped[str] = mapped_column(String(16))
    text: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
