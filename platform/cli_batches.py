"""`loraplex batches …`: a tenant's Batch API jobs from the shell, and the admin's batch price.

    loraplex batches submit requests.jsonl --endpoint /v1/chat/completions [--metadata k=v]
    loraplex batches list | status ID | cancel ID
    loraplex batches download ID [--output out.jsonl] [--errors errors.jsonl]
    loraplex batches price-factor TENANT FACTOR      (on the database, as `tenants …` is)

The tenant commands talk to a server (`--url`, default http://127.0.0.1:8000) with a tenant
key (`--api-key`, or LORAPLEX_API_KEY / OPENAI_API_KEY). Building the parser imports only the
standard library; a command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def add_parser(subparsers) -> None:
    b = subparsers.add_parser("batches", help="Batch API jobs: submit, list, status, download")
    sub = b.add_subparsers(dest="batches_cmd", required=True)

    def tenant_cmd(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--url", default=os.environ.get("LORAPLEX_URL", "http://127.0.0.1:8000"))
        p.add_argument("--api-key", default=None, help="default: LORAPLEX_API_KEY, OPENAI_API_KEY")
        p.add_argument("--json", action="store_true", help="print the API's JSON")
        p.set_defaults(func=run)
        return p

    s = tenant_cmd("submit", "upload a JSONL file of requests and start a batch of it")
    s.add_argument("file", type=Path)
    s.add_argument("--endpoint", choices=ENDPOINTS, default=ENDPOINTS[0])
    s.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    tenant_cmd("list", "the tenant's batches, newest first")
    for name, help in (("status", "one batch"), ("cancel", "cancel a running batch")):
        tenant_cmd(name, help).add_argument("batch_id")
    d = tenant_cmd("download", "write a finished batch's output (and error) file")
    d.add_argument("batch_id")
    d.add_argument("--output", type=Path, default=None, help="default: <batch id>_output.jsonl")
    d.add_argument("--errors", type=Path, default=None, help="default: <batch id>_error.jsonl")
    f = sub.add_parser("price-factor", help="set a tenant's batch price factor (database)")
    f.add_argument("tenant", help="name or id")
    f.add_argument("factor", help="a fraction of the tenant's prices, e.g. 0.5")
    f.set_defaults(func=run)


def _client(args):
    import httpx

    key = args.api_key or os.environ.get("LORAPLEX_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if not key:
        raise ValueError("no API key: pass --api-key or set LORAPLEX_API_KEY")
    return httpx.Client(base_url=args.url.rstrip("/"), timeout=120,
                        headers={"Authorization": f"Bearer {key}"})  # fmt: skip


def _ok(response) -> Any:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise ValueError(f"the server answered {response.status_code}: {message}")
    return response.json()


def _show(args, batch: dict) -> None:
    if args.json:
        print(json.dumps(batch, indent=2))
        return
    c = batch["request_counts"]
    print(f"{batch['id']}  {batch['status']:<11}  {c['completed']}/{c['total']} done, "
          f"{c['failed']} failed  {batch['endpoint']}")  # fmt: skip


def _price_factor(args) -> int:
    from decimal import Decimal, InvalidOperation

    from loraplex.platform.cli_admin import registry_session, resolve_tenant

    try:
        factor = Decimal(args.factor)
    except InvalidOperation:
        raise ValueError(f"factor {args.factor!r} is not a number") from None
    if not Decimal(0) <= factor <= Decimal(10):
        raise ValueError("the batch price factor must lie in [0, 10]")
    with registry_session() as session:
        tenant = resolve_tenant(session, args.tenant)
        tenant.batch_price_factor = factor
        session.commit()
        print(f"{tenant.name}: batch tokens at {factor} x its prices")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.batches_cmd == "price-factor":
        return _price_factor(args)
    with _client(args) as http:
        if args.batches_cmd == "submit":
            meta = dict(item.partition("=")[::2] for item in args.metadata)
            with args.file.open("rb") as f:
                uploaded = _ok(http.post("/v1/files", data={"purpose": "batch"},
                                         files={"file": (args.file.name, f)}))  # fmt: skip
            batch = _ok(http.post("/v1/batches", json={
                "input_file_id": uploaded["id"], "endpoint": args.endpoint,
                "completion_window": "24h", "metadata": meta or None}))  # fmt: skip
            _show(args, batch)
        elif args.batches_cmd == "list":
            for batch in _ok(http.get("/v1/batches", params={"limit": 100}))["data"]:
                _show(args, batch)
        elif args.batches_cmd in ("status", "cancel"):
            path = f"/v1/batches/{args.batch_id}"
            answer = http.post(f"{path}/cancel") if args.batches_cmd == "cancel" else http.get(path)
            _show(args, _ok(answer))
        elif args.batches_cmd == "download":
            batch = _ok(http.get(f"/v1/batches/{args.batch_id}"))
            if batch["output_file_id"] is None and batch["error_file_id"] is None:
                print(f"{batch['id']} is {batch['status']}: no files yet", file=sys.stderr)
                return 1
            for kind, dest in (("output", args.output), ("error", args.errors)):
                file_id = batch[f"{kind}_file_id"]
                if file_id is None:
                    continue
                dest = dest or Path(f"{batch['id']}_{kind}.jsonl")
                response = http.get(f"/v1/files/{file_id}/content")
                if response.status_code >= 400:
                    _ok(response)  # raises, with the server's message
                dest.write_bytes(response.content)
                print(f"{kind}: {dest}")
    return 0
