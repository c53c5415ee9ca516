"""`loraplex adapters …` and `loraplex usage export|summary`: reports over the registry, and
an adapter's versions and aliases (promote, canary split, rollback, delete a version).

`usage export` is the billing export: per tenant, tokens and their cost at the tenant's prices,
as CSV or JSON (the same rows as the admin API's `/billing`). As in cli_admin.py, building the
parser imports only the standard library; a command imports the registry when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from loraplex.platform.cli_admin import (
    columns,
    emit,
    json_flag,
    print_table,
    registry_session,
    resolve_tenant,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

ADAPTER_COLUMNS = columns(
    "tenant", "name", "version", "aliases", "rank", "alpha", "targets", "bytes", "status", "sha256",
    "created_at=CREATED",
)  # fmt: skip
VERSION_COLUMNS = columns(
    "version", "sha256", "bytes", "rank", "status", "created_at=CREATED",
    "last_used_at=LAST USED", "aliases",
)  # fmt: skip
ALIAS_COLUMNS = columns("alias", "weights=TRAFFIC", "previous", "updated_at=UPDATED")
SUMMARY_COLUMNS = {
    "tenant": columns("tenant"),
    "adapter": columns("tenant", "adapter"),
    "version": columns("tenant", "adapter", "version"),
    "day": columns("day"),
}
TOTAL_COLUMNS = columns(
    "requests", "prompt_tokens=PROMPT", "completion_tokens=COMPLETION", "cached_tokens=CACHED",
    "aborted", "errors",
)  # fmt: skip


def _short_sha(adapter: BaseModel) -> dict[str, str]:
    return {"sha256": adapter.sha256[:12]}  # enough to tell objects apart in a table


def _share(alias: str, weights: dict[str, int]) -> dict[int, str]:
    """Version -> its table cell for `alias`: the alias alone when the version takes all of
    its traffic, else with its share ("default 10%"). Versions as "3" or "v3"."""
    total = sum(weights.values())
    return {
        int(v.lstrip("v")): alias if w == total else f"{alias} {round(100 * w / total)}%"
        for v, w in weights.items()
    }


def _alias_shares(aliases) -> dict[tuple[int, str, int], list[str]]:
    """(tenant id, name, version) -> the cells of the aliases that send it traffic."""
    shares: dict[tuple[int, str, int], list[str]] = {}
    for a in aliases:
        for version, text in _share(a.alias, a.weights).items():
            shares.setdefault((a.tenant_id, a.name, version), []).append(text)
    return shares


def adapters_list(args: argparse.Namespace) -> int:
    from loraplex.platform.db import crud
    from loraplex.platform.db.schemas import AdapterPublic

    class AdminAdapter(AdapterPublic):
        tenant: str
        aliases: list[str]  # the name's aliases that send this version traffic

    with registry_session() as session:
        tenant_id = resolve_tenant(session, args.tenant).id if args.tenant else None
        names = {t.id: t.name for t in crud.list_tenants(session)}
        shares = _alias_shares(crud.list_aliases(session, tenant_id=tenant_id))
        rows = [
            AdminAdapter(
                **AdapterPublic.model_validate(a).model_dump(),
                tenant=names[a.tenant_id],
                # JSON gets the names; the table, each with its share of a split.
                aliases=[c.split(" ")[0] for c in shares.get((a.tenant_id, a.name, a.version), [])],
            )
            for a in crud.list_adapters(session, tenant_id=tenant_id)
        ]

    def cells(a: BaseModel) -> dict[str, Any]:
        assert isinstance(a, AdminAdapter)
        key = (a.tenant_id, a.name, a.version)
        return {**_short_sha(a), "version": f"v{a.version}", "aliases": shares.get(key, [])}

    emit(args, rows, ADAPTER_COLUMNS, cells)
    return 0


def adapters_gc(args: argparse.Namespace) -> int:
    from loraplex.platform.adapter_service import collect_unreferenced, store_for
    from loraplex.platform.db.session import make_sessionmaker
    from loraplex.platform.settings import Settings

    settings = Settings()
    if args.grace_s is None:
        args.grace_s = settings.store_gc_grace_s
    with registry_session() as session:  # checks the schema first
        sessions = make_sessionmaker(session.get_bind())
        state = SimpleNamespace(store=store_for(settings), sessions=sessions)
        report = collect_unreferenced(state, grace_s=args.grace_s)
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
    else:
        print(f"removed {len(report.removed)} unreferenced object(s); kept {report.kept_young} "
              f"younger than {args.grace_s:g}s; {report.referenced} in use")  # fmt: skip
    return 0


def _weights(weights: dict[str, int] | None) -> str:
    """{"v3": 90, "v4": 10} as "v3 90, v4 10" ("-" for none)."""
    return ", ".join(f"{v} {w}" for v, w in weights.items()) if weights else "-"


def _said(alias: BaseModel) -> str:
    from loraplex.platform.adapter_versions import AliasPublic

    assert isinstance(alias, AliasPublic)
    was = f" (was {_weights(alias.previous)})" if alias.previous else ""
    return f"{alias.name}@{alias.alias} -> {_weights(alias.weights)}{was}"


def adapters_versions(args: argparse.Namespace) -> int:
    from loraplex.platform import adapter_versions as versions
    from loraplex.platform.db import crud

    with registry_session() as session:
        tenant_id = resolve_tenant(session, args.tenant).id
        adapter = versions.get_public(session, tenant_id=tenant_id, name=args.name)
        aliases = [
            versions.alias_public(a)
            for a in crud.list_aliases(session, tenant_id=tenant_id, name=args.name)
        ]
    if args.json:
        print(adapter.model_dump_json(indent=2))
        return 0
    shares: dict[int, list[str]] = {}
    for name, weights in adapter.aliases.items():
        for version, text in _share(name, weights).items():
            shares.setdefault(version, []).append(text)
    print_table(
        [{**v.model_dump(), "version": f"v{v.version}", "sha256": v.sha256[:12],
          "aliases": shares.get(v.version, [])} for v in adapter.versions],
        VERSION_COLUMNS,
    )  # fmt: skip
    print()
    print_table(
        [{**a.model_dump(), "weights": _weights(a.weights), "previous": _weights(a.previous)}
         for a in aliases],
        ALIAS_COLUMNS,
    )  # fmt: skip
    return 0


def _set_alias(args: argparse.Namespace, body: dict) -> int:
    from loraplex.platform import adapter_versions as versions

    with registry_session() as session:
        tenant_id = resolve_tenant(session, args.tenant).id
        alias = versions.set_alias(
            session, tenant_id=tenant_id, name=args.name, alias=args.alias,
            body=versions.AliasIn(**body),
        )  # fmt: skip
    print(alias.model_dump_json(indent=2) if args.json else _said(alias))
    return 0


def adapters_promote(args: argparse.Namespace) -> int:
    return _set_alias(args, {"version": args.version})


def adapters_split(args: argparse.Namespace) -> int:
    weights: dict[str, int] = {}
    for pair in args.weights:
        version, _, weight = pair.partition("=")
        if not weight.strip().isdigit():
            raise ValueError(f"{pair!r}: write VERSION=WEIGHT, e.g. v3=90 v4=10")
        weights[version.strip()] = weights.get(version.strip(), 0) + int(weight)
    return _set_alias(args, {"weights": weights})


def adapters_rollback(args: argparse.Namespace) -> int:
    from loraplex.platform import adapter_versions as versions

    with registry_session() as session:
        tenant_id = resolve_tenant(session, args.tenant).id
        alias = versions.rollback_alias(
            session, tenant_id=tenant_id, name=args.name, alias=args.alias
        )
    print(alias.model_dump_json(indent=2) if args.json else _said(alias))
    return 0


def adapters_delete_version(args: argparse.Namespace) -> int:
    from loraplex.platform import adapter_versions as versions
    from loraplex.platform.adapter_service import store_for
    from loraplex.platform.settings import Settings

    with registry_session() as session:
        tenant = resolve_tenant(session, args.tenant)
        # The version's stored files go with its row, as the API's delete does.
        state = SimpleNamespace(store=store_for(Settings()))
        versions.delete_version(
            state, session, tenant_id=tenant.id, name=args.name, version=args.version
        )
    print(f"deleted {args.name}@{args.version} of tenant {tenant.name!r}")
    return 0


def usage_export(args: argparse.Namespace) -> int:
    from loraplex.platform import usage
    from loraplex.platform.periods import last_day, period

    start, end = period(args.start, args.end, names=("--from", "--to"))
    with registry_session() as session:
        rows = usage.billing_export(session, start=start, end=end, by=args.by)
    text = usage.to_csv(rows) if args.format == "csv" else usage.to_json(rows) + "\n"
    if args.output is None:
        sys.stdout.write(text)
        return 0
    Path(args.output).write_text(text)
    days = f"{start.date()} to {last_day(end)}"
    what = "tenant(s)" if args.by == "tenant" else "tenant/adapter version(s)"
    print(f"wrote billing of {len(rows)} {what} for {days} (UTC) to {args.output}")
    return 0


def usage_summary(args: argparse.Namespace) -> int:
    from loraplex.platform import usage
    from loraplex.platform.periods import period

    start, end = period(args.start, args.end, names=("--from", "--to"))
    with registry_session() as session:
        tenant_id = resolve_tenant(session, args.tenant).id if args.tenant else None
        rows = usage.usage_summary(
            session, start=start, end=end, group_by=args.group_by, tenant_id=tenant_id
        )
    if args.json:
        print(usage.to_json(rows))
        return 0
    table = [
        {
            **dataclasses.asdict(r),
            "adapter": r.adapter or "(base)",
            # The base model and rows from before versions were recorded have none.
            "version": "-" if r.version is None else f"v{r.version}",
        }
        for r in rows
    ]
    print_table(table, [*SUMMARY_COLUMNS[args.group_by], *TOTAL_COLUMNS])
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    out = json_flag()
    a = sub.add_parser("adapters", help="every tenant's adapters")
    asub = a.add_subparsers(dest="subcommand", required=True)
    p = asub.add_parser("list", parents=[out], help="list adapters")
    p.add_argument("--tenant", help="only this tenant's (name or id)")
    p.set_defaults(func=adapters_list)
    p = asub.add_parser(
        "gc",
        parents=[out],
        help="remove stored objects no adapter names (what a crash mid-upload or mid-delete "
        "leaves; servers also do it every store_gc_interval_s)",
    )
    p.add_argument("--grace-s", type=float, default=None,
                   help="keep unnamed objects younger than this, in seconds: uploads in flight "
                   "(default: the store_gc_grace_s setting)")  # fmt: skip
    p.set_defaults(func=adapters_gc)

    alias = argparse.ArgumentParser(add_help=False)
    alias.add_argument("--alias", default="default", help="which alias (default: default)")

    def named(verb: str, help: str, *parents: argparse.ArgumentParser):
        p = asub.add_parser(verb, parents=list(parents), help=help)
        p.add_argument("tenant", help="name or id")
        p.add_argument("name", help="the adapter's name")
        return p

    p = named("versions", "an adapter's versions and where each alias sends traffic", out)
    p.set_defaults(func=adapters_versions)
    p = named("promote", "send all of an alias's traffic to one version", alias, out)
    p.add_argument("version", help="v1, v2, ...")
    p.set_defaults(func=adapters_promote)
    p = named("split", "split an alias's traffic between versions by weight (a canary)", alias, out)
    p.add_argument("weights", nargs="+", metavar="VERSION=WEIGHT", help="e.g. v3=90 v4=10")
    p.set_defaults(func=adapters_split)
    p = named("rollback", "put an alias back where it pointed before its last change", alias, out)
    p.set_defaults(func=adapters_rollback)
    p = named("delete-version", "delete one version (refused while an alias uses it)")
    p.add_argument("version", help="v1, v2, ...")
    p.set_defaults(func=adapters_delete_version)

    u = sub.add_parser("usage", help="usage reports and billing exports")
    usub = u.add_subparsers(dest="subcommand", required=True)
    when = argparse.ArgumentParser(add_help=False)
    when.add_argument("--from", dest="start", help="ISO date/datetime (default: month start)")
    when.add_argument("--to", dest="end", help="ISO date (inclusive) or datetime (exclusive)")
    p = usub.add_parser("export", parents=[when], help="billing per tenant: tokens and cost")
    p.add_argument("--format", choices=["csv", "json"], default="csv")
    p.add_argument("--output", "-o", help="file to write (default: stdout)")
    p.add_argument(
        "--by",
        choices=["tenant", "version"],
        default="tenant",
        help="one row per tenant, or per tenant, adapter and the adapter version that answered",
    )
    p.set_defaults(func=usage_export)
    p = usub.add_parser("summary", parents=[when, out], help="requests and tokens per group")
    p.add_argument("--group-by", choices=["tenant", "adapter", "version", "day"], default="tenant")
    p.add_argument("--tenant", help="only this tenant (name or id)")
    p.set_defaults(func=usage_summary)
