"""Pydantic shapes of the registry rows: XCreate / XUpdate validate input, XPublic is output.

The CRUD functions validate through these, so the HTTP API, the CLI and tests all get the
same rules and messages. No XPublic carries a key hash or a storage key.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, StringConstraints

from loraplex.platform.db.models import AdapterStatus, TenantStatus
from loraplex.platform.names import AdapterName

# Names travel in URLs and in the OpenAI `model` field: no slashes, spaces or leading dots.
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=64)]
# Plain notation in JSON: a zero read back from Numeric(18, 9) would print as "0E-9".
Price = Annotated[
    Decimal,
    # Not strict even in strict bodies: JSON has no decimals, so a number or "0.25" is a price.
    Field(ge=0, max_digits=18, decimal_places=9, strict=False),
    PlainSerializer(lambda d: format(d.normalize(), "f"), return_type=str, when_used="json"),
]
Limit = Annotated[int | None, Field(ge=0)]
Target = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]  # "q_proj"


class _Row(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class TenantBase(BaseModel):
    name: Name
    weight: float = Field(1.0, gt=0, description="fair-share weight against other tenants")
    price_prompt_per_1k: Price = Decimal(0)
    price_completion_per_1k: Price = Decimal(0)


class TenantCreate(TenantBase):
    pass


class TenantUpdate(BaseModel):
    model_config = ConfigDict(use_enum_values=True)

    weight: float | None = Field(None, gt=0)
    price_prompt_per_1k: Price | None = None
    price_completion_per_1k: Price | None = None
    status: TenantStatus | None = Field(None, strict=False)  # JSON gives the enum's string


class TenantPublic(TenantBase, _Row):
    id: int
    status: TenantStatus
    created_at: datetime


class QuotaBase(BaseModel):
    """Limits of one tenant; None is unlimited."""

    requests_per_min: Limit = None
    tokens_per_min: Limit = None
    tokens_per_month: Limit = None
    max_adapters: Limit = None
    max_adapter_bytes: Limit = Field(None, description="all the tenant's adapters together")
    max_rank: Limit = None
    batch_tokens_per_month: Limit = Field(
        None, description="Batch API tokens a month, on top of the limits above"
    )


class QuotaPublic(QuotaBase, _Row):
    tenant_id: int


class ApiKeyCreate(BaseModel):
    name: Name = "default"
    expires_at: datetime | None = Field(None, strict=False)  # an ISO 8601 string in JSON


class ApiKeyPublic(_Row):
    id: int
    tenant_id: int
    name: str
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None


class ApiKeyCreated(ApiKeyPublic):
    secret: str = Field(description="shown once; only its hash is stored")


class AdapterBase(BaseModel):
    name: AdapterName
    base_model: str = Field(min_length=1, max_length=255)
    rank: int = Field(gt=0)
    alpha: float
    targets: list[Target] = Field(min_length=1)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class AdapterCreate(AdapterBase):
    model_config = ConfigDict(use_enum_values=True)

    storage_key: str = Field(min_length=1, max_length=512)
    status: AdapterStatus = AdapterStatus.ready


class AdapterPublic(AdapterBase, _Row):
    id: int
    tenant_id: int
    version: int
    status: AdapterStatus
    created_at: datetime
    last_used_at: datetime | None
