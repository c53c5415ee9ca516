"""`loraplex adapters list` and `loraplex usage export|summary`: reports over the registry.

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
from typing import TYPE_CHECKING

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
    "tenant", "name", "rank", "alpha", "targets", "bytes", "status", "sha256", "created_at=CREATED"
)
SUMMARY_COLUMNS = {
    "tenant": columns("tenant"),
    "adapter": columns("tenant", "adapter"),
    "day": columns("day"),
}
TOTAL_COLUMNS = columns(
    "requests", "prompt_tokens=PROMPT", "completion_tokens=COMPLETION", "cached_tokens=CACHED",
    "aborted", "errors",
)  # fmt: skip


def _short_sha(adapter: BaseModel) -> dict[str, str]:
    return {"sha256": adapter.sha256[:12]}  # enough to tell objects apart in a table


def adapters_list(args: argparse.Namespace) -> int:
    from loraplex.platform.db import crud
    from loraplex.platform.db.schemas import AdapterPublic

    class AdminAdapter(AdapterPublic):
        tenant: str

    with registry_session() as session:
        tenant_id = resolve_tenant(session, args.tenant).id if args.tenant else None
        names = {t.id: t.name for t in crud.list_tenants(session)}
        rows = [
            AdminAdapter(**AdapterPublic.model_validate(a).model_dump(), tenant=names[a.tenant_id])
            for a in crud.list_adapters(session, tenant_id=tenant_id)
        ]
    emit(args, rows, ADAPTER_COLUMNS, _short_sha)
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
    table = [{**dataclasses.asdict(r), "adapter": r.adapter or "(base)"} for r in rows]
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
    p.add_argument(
        "--group-by", choices=["tenant", "adapter", "version", "day"], default="tenant"
    )
    p.add_argument("--tenant", help="only this tenant (name or id)")
    p.set_defaults(func=usage_summary)
