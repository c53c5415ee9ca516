"""`loraplex tenants|keys|quotas …`: registry administration straight on the database.

Each command opens the database of the current settings (`LORAPLEX_*`, `LORAPLEX_CONFIG`), so
no server needs to run (except `--end-streams URL`, which asks that running server to end the
streams of a revoked key or suspended tenant at once, through its admin API). Output is a
table for humans, JSON with `--json` for scripts, in the admin API's shapes. Tenants are
named by name or id. Reports (adapters, usage) are in `cli_reports.py`, on the helpers here.

Building the parser imports only the standard library (`loraplex --help` answers at once); a
command imports the registry (SQLAlchemy, pydantic) when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel
    from sqlalchemy.orm import Session

    from loraplex.platform.db.models import Tenant

Columns = Sequence[tuple[str, str]]  # (field, heading)
END_STREAMS = (
    "also end the running streams on the server at URL now (repeat for each replica; uses "
    "LORAPLEX_ADMIN_KEY); without it they finish"
)


def columns(*spec: str) -> Columns:
    """Table columns from "field" (heading: FIELD) or "field=HEADING"."""
    pairs = [item.partition("=") for item in spec]
    return [(field, heading or field.upper()) for field, _, heading in pairs]


TENANT_COLUMNS = columns(
    "id", "name", "status", "weight", "price_prompt_per_1k=PROMPT/1K",
    "price_completion_per_1k=COMPLETION/1K", "created_at=CREATED",
)  # fmt: skip
KEY_COLUMNS = columns(
    "id", "name", "prefix", "state", "created_at=CREATED", "last_used_at=LAST USED",
    "expires_at=EXPIRES",
)  # fmt: skip
# The values of db.models.TenantStatus and the fields of db.schemas.QuotaBase, written out so
# the parser needs neither module (tests/platform/test_cli_lazy.py checks they agree).
TENANT_STATUSES = ("active", "suspended")
QUOTA_FIELDS = [
    "requests_per_min", "tokens_per_min", "tokens_per_month", "max_adapters", "max_adapter_bytes",
    "max_rank", "batch_tokens_per_month",
]  # fmt: skip
QUOTA_COLUMNS = columns("tenant_id=TENANT", *QUOTA_FIELDS)


@contextmanager
def registry_session() -> Iterator[Session]:
    """A session on the database of the current settings, refusing an unmigrated schema."""
    from loraplex.platform.db.session import ensure_at_head, make_engine, make_sessionmaker
    from loraplex.platform.settings import Settings

    settings = Settings()
    db = make_engine(settings.database_url)
    try:
        ensure_at_head(db)  # else "no such table", which does not say what to run
        with make_sessionmaker(db)() as session:
            yield session
    finally:
        db.dispose()


def resolve_tenant(session: Session, ref: str) -> Tenant:
    """The tenant named `ref`, or numbered `ref` (names may be digits: refuse ambiguity)."""
    from loraplex.platform.db import crud

    by_name = crud.get_tenant_by_name(session, name=ref)
    by_id = crud.get_tenant(session, tenant_id=int(ref)) if ref.isdigit() else None
    if by_name is not None and by_id is not None and by_name.id != by_id.id:
        raise ValueError(
            f"{ref!r} is ambiguous: the name of tenant {by_name.id} and the id of tenant "
            f"{by_id.name!r}; say {by_name.id} or {by_id.name!r} instead"
        )
    tenant = by_name or by_id
    if tenant is None:
        nor_id = " nor one with that id" if ref.isdigit() else ""
        raise crud.NotFound(f"no tenant named {ref!r}{nor_id}")
    return tenant


# --- output --------------------------------------------------------------------------------


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, Decimal):
        return format(value.normalize(), "f")  # 0.001500000 -> 0.0015
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M")
    if isinstance(value, list | tuple):
        return ",".join(map(str, value))
    return str(value)


def print_table(rows: Sequence[dict[str, Any]], columns: Columns) -> None:
    if not rows:
        print("(none)")
        return
    cells = [[cell(row[field]) for field, _ in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, (_, h) in enumerate(columns)]
    for line in [[h for _, h in columns], *cells]:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())


def emit(
    args: argparse.Namespace,
    models: Sequence[BaseModel],
    columns: Columns,
    extra: Callable[[BaseModel], dict[str, Any]] | None = None,
    *,
    one: bool = False,
) -> None:
    """Print `models` as JSON (`--json`; one object when `one`) or as a table."""
    if args.json:
        data = [m.model_dump(mode="json") for m in models]
        print(json.dumps(data[0] if one else data, indent=2))
    else:
        print_table([{**m.model_dump(), **(extra(m) if extra else {})} for m in models], columns)


def _key_state(key: BaseModel) -> dict[str, str]:
    from loraplex.platform.db.models import utcnow
    from loraplex.platform.db.schemas import ApiKeyPublic

    assert isinstance(key, ApiKeyPublic)
    if key.revoked_at is not None:
        return {"state": "revoked"}
    expired = key.expires_at is not None and key.expires_at <= utcnow()
    return {"state": "expired" if expired else "active"}


# --- tenants -------------------------------------------------------------------------------


def tenants_create(args: argparse.Namespace) -> int:
    from loraplex.platform.db import crud
    from loraplex.platform.db.schemas import TenantPublic

    with registry_session() as session:
        tenant = crud.create_tenant(
            session,
            name=args.name,
            weight=args.weight,
            price_prompt_per_1k=args.price_prompt,
            price_completion_per_1k=args.price_completion,
        )
        emit(args, [TenantPublic.model_validate(tenant)], TENANT_COLUMNS, one=True)
    return 0


def tenants_list(args: argparse.Namespace) -> int:
    from loraplex.platform.db import crud
    from loraplex.platform.db.schemas import TenantPublic

    with registry_session() as session:
        rows = crud.list_tenants(session, status=args.status)
        emit(args, [TenantPublic.model_validate(t) for t in rows], TENANT_COLUMNS)
    return 0


def tenants_update(args: argparse.Namespace) -> int:
    changes = {
        "weight": args.weight,
        "price_prompt_per_1k": args.price_prompt,
        "price_completion_per_1k": args.price_completion,
        "status": args.status,
    }
    if all(v is None for v in changes.values()):
        raise ValueError(
            "nothing to update: give --weight, --price-prompt, --price-completion or --status"
        )
    from loraplex.platform.db import crud
    from loraplex.platform.db.schemas import TenantPublic

    with registry_session() as session:
        tenant_id = resolve_tenant(session, args.tenant).id
        tenant = crud.update_tenant(session, tenant_id=tenant_id, **changes)
        emit(args, [TenantPublic.model_validate(tenant)], TENANT_COLUMNS, one=True)
    return 0


def tenants_rotate_cache_salt(args: argparse.Namespace) -> int:
    """A new prefix-cache salt for the tenant: its cached KV unreachable (docs/kv-tiers.md)."""
    from loraplex.platform.db import cache_salts

    with registry_session() as session:
        tenant = resolve_tenant(session, args.tenant)
        name, tenant_id = tenant.name, tenant.id
        cache_salts.rotate(session, tenant_id)
    print(f"tenant {name} (id {tenant_id}): cache salt rotated; its cached KV is unreachable")
    return 0


def end_streams(urls: list[str] | None, method: str, path: str, body: dict | None = None) -> None:
    """Repeat an admin call with `end_streams=true` on each server in `urls` (each replica
    ends the streams it runs; the registry change itself is already made, and idempotent)."""
    if not urls:
        return
    import httpx

    from loraplex.platform.settings import Settings

    admin_key = Settings().admin_key
    if admin_key is None:
        raise ValueError("--end-streams calls the server's admin API: set LORAPLEX_ADMIN_KEY")
    headers = {"Authorization": f"Bearer {admin_key.get_secret_value()}"}
    for url in urls:
        try:
            r = httpx.request(
                method, f"{url.rstrip('/')}/admin/api{path}", params={"end_streams": "true"},
                json=body, headers=headers, timeout=30,
            )  # fmt: skip
        except httpx.HTTPError as e:
            raise ValueError(f"--end-streams {url}: {e}") from None
        if r.status_code >= 400:
            raise ValueError(f"--end-streams {url}: HTTP {r.status_code}: {r.text[:300]}")
        ended = r.headers.get("loraplex-streams-ended", "?")
        print(f"{url}: {ended} running stream(s) ended", file=sys.stderr)


def _set_status(value: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from loraplex.platform.db import crud
        from loraplex.platform.db.models import TenantStatus
        from loraplex.platform.db.schemas import TenantPublic

        status = TenantStatus(value)
        with registry_session() as session:
            tenant_id = resolve_tenant(session, args.tenant).id
            tenant = crud.update_tenant(session, tenant_id=tenant_id, status=status)
            emit(args, [TenantPublic.model_validate(tenant)], TENANT_COLUMNS, one=True)
        urls = getattr(args, "end_streams", None)
        end_streams(urls, "PATCH", f"/tenants/{tenant_id}", {"status": status.value})
        return 0

    return run


# --- keys ----------------------------------------------------------------------------------


def keys_create(args: argparse.Namespace) -> int:
    from loraplex.platform.db import crud
    from loraplex.platform.db.models import utcnow
    from loraplex.platform.db.schemas import ApiKeyCreated, ApiKeyPublic
    from loraplex.platform.periods import parse_moment

    expires_at = parse_moment(args.expires, end=True, name="--expires") if args.expires else None
    if expires_at is not None and expires_at <= utcnow():
        raise ValueError(f"--expires {args.expires} is in the past: the key would never work")
    with registry_session() as session:
        tenant = resolve_tenant(session, args.tenant)
        secret, key = crud.create_key(
            session, tenant_id=tenant.id, name=args.name, expires_at=expires_at
        )
        public = ApiKeyPublic.model_validate(key)
    if args.json:
        print(ApiKeyCreated(**public.model_dump(), secret=secret).model_dump_json(indent=2))
        return 0
    until = f", valid until {cell(expires_at)} UTC" if expires_at else ""
    print(f"created key {key.id} '{key.name}' for tenant '{tenant.name}' ({key.prefix}{until})")
    print("the secret is shown only this once; store it now:")
    print(secret)
    return 0


def keys_list(args: argparse.Namespace) -> int:
    from loraplex.platform.db import crud

    with registry_session() as session:
        keys = crud.list_keys(session, tenant_id=resolve_tenant(session, args.tenant).id)
        emit(args, keys, KEY_COLUMNS, _key_state)
    return 0


def keys_revoke(args: argparse.Namespace) -> int:
    from loraplex.platform.db import crud
    from loraplex.platform.db.schemas import ApiKeyPublic

    with registry_session() as session:
        key = ApiKeyPublic.model_validate(crud.revoke_key(session, key_id=args.key_id))
        emit(args, [key], KEY_COLUMNS, _key_state, one=True)
    end_streams(args.end_streams, "POST", f"/keys/{args.key_id}/revoke")
    return 0


# --- quotas --------------------------------------------------------------------------------


_UNSET: Any = object()  # tells "not given" apart from "unlimited" (None) in `quotas set`


def _limit(text: str) -> int | None:
    if text.lower() in ("none", "unlimited"):
        return None
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number or 'unlimited'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: limits cannot be negative")
    return value


def quotas_set(args: argparse.Namespace) -> int:
    from loraplex.platform.db import crud
    from loraplex.platform.db.schemas import QuotaPublic

    given = {f: getattr(args, f) for f in QUOTA_FIELDS if getattr(args, f) is not _UNSET}
    if not given:
        flags = ", ".join("--" + f.replace("_", "-") for f in QUOTA_FIELDS)
        raise ValueError(f"no limit given: use one or more of {flags}")
    with registry_session() as session:
        tenant_id = resolve_tenant(session, args.tenant).id
        current = crud.get_quota(session, tenant_id=tenant_id)
        # Unlike the API's PUT, limits not named here keep their value: `quotas set --tenant x
        # --max-rank 16` must not quietly lift the tenant's rate limits.
        limits = {f: getattr(current, f) if current else None for f in QUOTA_FIELDS}
        quota = crud.set_quota(session, tenant_id=tenant_id, **{**limits, **given})
        emit(args, [QuotaPublic.model_validate(quota)], QUOTA_COLUMNS, one=True)
    return 0


def quotas_show(args: argparse.Namespace) -> int:
    from loraplex.platform.db import crud
    from loraplex.platform.db.schemas import QuotaPublic

    with registry_session() as session:
        tenant_id = resolve_tenant(session, args.tenant).id
        quota = crud.get_quota(session, tenant_id=tenant_id)
        public = QuotaPublic.model_validate(quota) if quota else QuotaPublic(tenant_id=tenant_id)
        emit(args, [public], QUOTA_COLUMNS, one=True)
    return 0


# --- parser --------------------------------------------------------------------------------


def json_flag() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return out


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    out = json_flag()

    def group(name: str, help: str) -> argparse._SubParsersAction:  # type: ignore[type-arg]
        parser = sub.add_parser(name, help=help)
        return parser.add_subparsers(dest="subcommand", required=True)

    def prices(p: argparse.ArgumentParser, weight: float | None, price: str | None) -> None:
        # Prices stay text until pydantic reads them as exact Decimals.
        p.add_argument("--weight", type=float, default=weight, help="fair-share weight (> 0)")
        p.add_argument("--price-prompt", default=price, help="price per 1k prompt tokens")
        p.add_argument("--price-completion", default=price, help="per 1k completion tokens")

    t = group("tenants", "create, list, update, suspend tenants")
    p = t.add_parser("create", parents=[out], help="create a tenant")
    p.add_argument("name")
    prices(p, 1.0, "0")
    p.set_defaults(func=tenants_create)
    p = t.add_parser("list", parents=[out], help="list tenants")
    p.add_argument("--status", choices=TENANT_STATUSES)
    p.set_defaults(func=tenants_list)
    p = t.add_parser("update", parents=[out], help="change weight, prices or status")
    p.add_argument("tenant", help="name or id")
    prices(p, None, None)
    p.add_argument("--status", choices=TENANT_STATUSES)
    p.set_defaults(func=tenants_update)
    for verb, status, what in (
        ("suspend", "suspended", "refuse the tenant's keys (401)"),
        ("activate", "active", "accept the tenant's keys again"),
    ):
        p = t.add_parser(verb, parents=[out], help=what)
        p.add_argument("tenant", help="name or id")
        if status == "suspended":
            p.add_argument("--end-streams", action="append", metavar="URL", help=END_STREAMS)
        p.set_defaults(func=_set_status(status))
    p = t.add_parser("rotate-cache-salt", help="drop the tenant's cached KV on every replica")
    p.add_argument("tenant", help="name or id")
    p.set_defaults(func=tenants_rotate_cache_salt)

    k = group("keys", "create, list, revoke API keys")
    p = k.add_parser("create", parents=[out], help="create a key (the secret is printed once)")
    p.add_argument("--tenant", required=True, help="name or id")
    p.add_argument("--name", default="default")
    p.add_argument("--expires", help="ISO 8601 date (valid through that day, UTC) or datetime")
    p.set_defaults(func=keys_create)
    p = k.add_parser("list", parents=[out], help="a tenant's keys (display prefix only)")
    p.add_argument("--tenant", required=True, help="name or id")
    p.set_defaults(func=keys_list)
    p = k.add_parser("revoke", parents=[out], help="revoke a key at once")
    p.add_argument("key_id", type=int)
    p.add_argument("--end-streams", action="append", metavar="URL", help=END_STREAMS)
    p.set_defaults(func=keys_revoke)

    q = group("quotas", "show and set a tenant's limits")
    p = q.add_parser("set", parents=[out], help="set limits; those not named keep their value")
    p.add_argument("--tenant", required=True, help="name or id")
    for field in QUOTA_FIELDS:
        p.add_argument(
            "--" + field.replace("_", "-"), dest=field, type=_limit, default=_UNSET,
            metavar="N|unlimited",
        )  # fmt: skip
    p.set_defaults(func=quotas_set)
    p = q.add_parser("show", parents=[out], help="a tenant's limits (- is unlimited)")
    p.add_argument("--tenant", required=True, help="name or id")
    p.set_defaults(func=quotas_show)
