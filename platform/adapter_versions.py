"""Versions and aliases of a tenant's adapter, as the tenant API, the admin API, the CLI and
the dashboard show and change them: one set of operations, each an atomic registry change,
with OpenAI-style errors (404 unknown name, version or alias; 409 a version still in use; 400
a bad split).

A split's weights are integers (percentages by convention, any positive integers work); an
alias change commits one row, so every replica's next request follows it, while requests
already running finish on the version they started on.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.platform.adapter_refs import ALIAS_RULE, is_alias_name, parse_version
from loraplex.platform.adapter_service import remove_version
from loraplex.platform.db import crud
from loraplex.platform.db.models import Adapter, AdapterAlias
from loraplex.platform.errors import APIError


class VersionPublic(BaseModel):
    id: str  # what a request's `model` pins it with: name@vN
    object: str = "adapter.version"
    version: int
    sha256: str
    bytes: int
    rank: int
    alpha: float
    targets: list[str]
    status: str
    created_at: datetime
    last_used_at: datetime | None
    aliases: list[str]  # the aliases that send it traffic


class AdapterPublic(BaseModel):
    """An adapter name: its newest version's details at the top (as before versions), every
    version, and where each alias sends traffic ({"default": {"v1": 100}})."""

    id: str
    object: str = "adapter"
    name: str
    base_model: str
    version: int  # the newest version (or, after an upload, the one just made)
    rank: int
    alpha: float
    targets: list[str]
    bytes: int  # of all versions together
    sha256: str
    status: str
    created_at: datetime
    last_used_at: datetime | None
    versions: list[VersionPublic]
    aliases: dict[str, dict[str, int]]


class AliasIn(BaseModel):
    """Point an alias at one version (`version`) or split it (`weights`)."""

    model_config = ConfigDict(extra="forbid")
    version: str | int | None = Field(None, description='one version: "v4" (or 4)')
    weights: dict[str, int] | None = Field(
        None, description='a split by positive integer weights: {"v3": 90, "v4": 10}'
    )

    @model_validator(mode="after")
    def _one_of(self) -> AliasIn:
        if (self.version is None) == (self.weights is None):
            raise ValueError("give either 'version' or 'weights'")
        return self

    def as_weights(self) -> dict[int, int]:
        try:
            if self.version is not None:
                return {parse_version(self.version): 100}
            assert self.weights is not None
            out: dict[int, int] = {}
            for key, weight in self.weights.items():
                if weight <= 0:
                    raise ValueError(f"the weight of {key!r} must be above 0")
                out[parse_version(key)] = out.get(parse_version(key), 0) + weight
        except ValueError as e:
            raise APIError(400, str(e), "invalid_value", "weights") from None
        if not out:
            raise APIError(400, "weights: give at least one version", "invalid_value", "weights")
        return out


class AliasPublic(BaseModel):
    object: str = "adapter.alias"
    name: str
    alias: str
    weights: dict[str, int]
    previous: dict[str, int] | None
    updated_at: datetime


def _shown(weights: dict[str, int] | None) -> dict[str, int] | None:
    if weights is None:
        return None
    return {f"v{v}": w for v, w in sorted(weights.items(), key=lambda kv: int(kv[0]))}


def alias_public(row: AdapterAlias) -> AliasPublic:
    return AliasPublic(
        name=row.name,
        alias=row.alias,
        weights=_shown(row.weights) or {},
        previous=_shown(row.previous),
        updated_at=row.updated_at,
    )


def describe(
    versions: list[Adapter], aliases: list[AdapterAlias], current: Adapter | None = None
) -> AdapterPublic:
    """One name's public view from its version rows (oldest first) and alias rows."""
    top = current or versions[-1]
    using: dict[int, list[str]] = {}
    for alias in aliases:
        for v in alias.weights:
            using.setdefault(int(v), []).append(alias.alias)
    return AdapterPublic(
        id=top.name,
        name=top.name,
        base_model=top.base_model,
        version=top.version,
        rank=top.rank,
        alpha=top.alpha,
        targets=list(top.targets),
        bytes=sum(v.bytes for v in versions),
        sha256=top.sha256,
        status=str(top.status),
        created_at=top.created_at,
        last_used_at=max((v.last_used_at for v in versions if v.last_used_at), default=None),
        versions=[
            VersionPublic(
                id=f"{v.name}@v{v.version}",
                version=v.version,
                sha256=v.sha256,
                bytes=v.bytes,
                rank=v.rank,
                alpha=v.alpha,
                targets=list(v.targets),
                status=str(v.status),
                created_at=v.created_at,
                last_used_at=v.last_used_at,
                aliases=sorted(using.get(v.version, [])),
            )
            for v in versions
        ],
        aliases={a.alias: _shown(a.weights) or {} for a in aliases},
    )


def list_public(session, *, tenant_id: int | None) -> list[tuple[int, AdapterPublic]]:
    """(tenant id, adapter) for each adapter name of a tenant, or of all with None."""
    grouped: dict[tuple[int, str], list[Adapter]] = {}
    for row in crud.list_adapters(session, tenant_id=tenant_id):
        grouped.setdefault((row.tenant_id, row.name), []).append(row)
    aliases: dict[tuple[int, str], list[AdapterAlias]] = {}
    for a in crud.list_aliases(session, tenant_id=tenant_id):
        aliases.setdefault((a.tenant_id, a.name), []).append(a)
    return [(key[0], describe(rows, aliases.get(key, []))) for key, rows in grouped.items()]


def not_found(name: str) -> APIError:
    return APIError(404, f"no adapter named {name[:80]!r}", "adapter_not_found", "name")


def get_public(session, *, tenant_id: int, name: str) -> AdapterPublic:
    rows = crud.list_adapters(session, tenant_id=tenant_id, name=name)
    if not rows:
        raise not_found(name)
    return describe(rows, crud.list_aliases(session, tenant_id=tenant_id, name=name))


def check_alias_name(alias: str) -> None:
    if not is_alias_name(alias):
        raise APIError(400, f"alias {alias[:80]!r}: {ALIAS_RULE}", "invalid_name", "alias")


def set_alias(session, *, tenant_id: int, name: str, alias: str, body: AliasIn) -> AliasPublic:
    check_alias_name(alias)
    weights = body.as_weights()
    try:
        row = crud.set_alias(session, tenant_id=tenant_id, name=name, alias=alias, weights=weights)
    except crud.NotFound as e:
        raise APIError(404, str(e), "adapter_not_found", "version") from None
    return alias_public(row)


def rollback_alias(session, *, tenant_id: int, name: str, alias: str) -> AliasPublic:
    try:
        row = crud.rollback_alias(session, tenant_id=tenant_id, name=name, alias=alias)
    except crud.NotFound as e:
        raise APIError(404, str(e), "adapter_not_found", "alias") from None
    return alias_public(row)


def delete_alias(session, *, tenant_id: int, name: str, alias: str) -> None:
    try:
        crud.delete_alias(session, tenant_id=tenant_id, name=name, alias=alias)
    except crud.InUse as e:
        raise APIError(409, str(e), "alias_in_use", "alias") from None
    except crud.NotFound as e:
        raise APIError(404, str(e), "adapter_not_found", "alias") from None


def delete_version(state, session, *, tenant_id: int, name: str, version: str) -> None:
    try:
        number = parse_version(version)
    except ValueError as e:
        raise APIError(404, str(e), "adapter_not_found", "version") from None
    try:
        found = remove_version(state, session, tenant_id=tenant_id, name=name, version=number)
    except crud.InUse as e:
        raise APIError(409, str(e), "version_in_use", "version") from None
    if not found:
        raise APIError(404, f"adapter {name!r} has no version v{number}", "adapter_not_found")
