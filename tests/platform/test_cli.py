"""The admin CLI, run in-process on a SQLite registry: outputs, database effects, errors."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from loraplex.platform.cli import main
from loraplex.platform.db import crud
from loraplex.platform.db.session import make_engine, make_sessionmaker
from loraplex.platform.usage import record_usage


@dataclass
class Result:
    code: int
    out: str
    err: str


@dataclass
class CLI:
    capsys: pytest.CaptureFixture[str]
    url: str

    def __call__(self, *argv: str) -> Result:
        self.capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's usage errors
            code = int(e.code or 0)
        out, err = self.capsys.readouterr()
        return Result(code, out, err)

    def ok(self, *argv: str) -> str:
        result = self(*argv)
        assert result.code == 0, result.err
        return result.out

    def json(self, *argv: str):
        return json.loads(self.ok(*argv, "--json"))

    def fails(self, *argv: str) -> str:
        """The one-line error of a command that must fail with exit code 2."""
        result = self(*argv)
        assert result.code == 2, result.out
        assert result.err.startswith("loraplex: error: ") and result.err.count("\n") == 1
        return result.err

    @contextmanager
    def session(self) -> Iterator[Session]:
        db = make_engine(self.url)
        try:
            with make_sessionmaker(db)() as session:
                yield session
        finally:
            db.dispose()


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Settings pointing at a fresh SQLite file; the URL of that database."""
    for var in [v for v in os.environ if v.startswith("LORAPLEX_")]:
        monkeypatch.delenv(var)
    url = f"sqlite:///{tmp_path / 'data' / 'registry.db'}"
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", url)
    return url


@pytest.fixture
def cli(env: str, capsys: pytest.CaptureFixture[str]) -> CLI:
    runner = CLI(capsys, env)
    assert "database at head" in runner.ok("db", "upgrade")
    return runner


@pytest.fixture
def acme(cli: CLI) -> int:
    created = cli.json("tenants", "create", "acme", "--price-prompt", "0.0015",
                       "--price-completion", "0.002")  # fmt: skip
    return created["id"]


def test_commands_refuse_a_database_that_is_not_migrated(env, capsys):
    err = CLI(capsys, env).fails("tenants", "list")
    assert "loraplex db upgrade" in err


def test_tenants_create_list_update_suspend(cli, acme):
    table = cli.ok("tenants", "create", "beta", "--weight", "2.5")
    assert table.splitlines()[0].split()[:3] == ["ID", "NAME", "STATUS"]
    assert "beta" in table and "2.5" in table
    listed = cli.json("tenants", "list")
    assert [t["name"] for t in listed] == ["acme", "beta"]
    assert Decimal(listed[0]["price_prompt_per_1k"]) == Decimal("0.0015")  # exact, a string
    assert "0.0015" in cli.ok("tenants", "list")  # tables drop the trailing zeros

    assert "already exists" in cli.fails("tenants", "create", "acme")
    assert "weight" in cli.fails("tenants", "create", "gamma", "--weight", "0")
    assert "nothing to update" in cli.fails("tenants", "update", "acme")

    cli.ok("tenants", "update", "acme", "--weight", "3", "--price-completion", "0.004")
    assert cli.json("tenants", "suspend", str(acme))["status"] == "suspended"
    assert [t["name"] for t in cli.json("tenants", "list", "--status", "suspended")] == ["acme"]
    with cli.session() as session:
        tenant = crud.get_tenant(session, tenant_id=acme)
        assert (tenant.weight, tenant.status) == (3.0, "suspended")
        assert tenant.price_completion_per_1k == Decimal("0.004")
    cli.ok("tenants", "activate", "acme")
    with cli.session() as session:
        assert crud.get_tenant(session, tenant_id=acme).status == "active"


def test_tenant_names_that_are_digits_are_never_confused_with_ids(cli, acme):
    cli.ok("tenants", "create", str(acme))  # a tenant *named* like acme's id
    assert "ambiguous" in cli.fails("keys", "list", "--tenant", str(acme))
    assert "no tenant named 'nobody'" in cli.fails("keys", "list", "--tenant", "nobody")


def test_key_secret_is_printed_once_and_revoke_stops_it(cli, acme):
    out = cli.ok("keys", "create", "--tenant", "acme", "--name", "ci")
    secret = out.strip().splitlines()[-1]
    assert secret.startswith("lpx_") and "shown only this once" in out
    with cli.session() as session:
        tenant, key = crud.authenticate(session, secret)
        assert (tenant.id, key.name) == (acme, "ci")

    listing = cli.ok("keys", "list", "--tenant", str(acme))
    assert secret[:12] in listing and secret not in listing and "active" in listing
    (public,) = cli.json("keys", "list", "--tenant", "acme")
    assert public["prefix"] == secret[:12] and not {"secret", "key_hash"} & public.keys()

    assert cli.json("keys", "revoke", str(key.id))["revoked_at"] is not None
    with cli.session() as session:
        assert crud.authenticate(session, secret) is None
    assert "revoked" in cli.ok("keys", "list", "--tenant", "acme")
    assert "no API key with id 999" in cli.fails("keys", "revoke", "999")


def test_key_expiry_dates_cover_the_whole_day(cli, acme):
    created = cli.json("keys", "create", "--tenant", "acme", "--expires", "2099-01-31")
    assert created["secret"].startswith("lpx_")
    with cli.session() as session:
        (key,) = crud.list_keys(session, tenant_id=acme)
    assert key.expires_at == datetime(2099, 2, 1, tzinfo=UTC)
    assert "in the past" in cli.fails(
        "keys", "create", "--tenant", "acme", "--expires", "2001-01-01"
    )
    assert "ISO 8601" in cli.fails("keys", "create", "--tenant", "acme", "--expires", "soon")


def test_quotas_set_changes_only_the_limits_named(cli, acme):
    cli.ok("quotas", "set", "--tenant", "acme", "--requests-per-min", "60",
           "--tokens-per-month", "1_000_000")  # fmt: skip
    shown = cli.json("quotas", "set", "--tenant", "acme", "--max-rank", "8")
    assert (shown["requests_per_min"], shown["tokens_per_month"], shown["max_rank"]) == (
        60, 1_000_000, 8,
    )  # fmt: skip
    cli.ok("quotas", "set", "--tenant", "acme", "--requests-per-min", "unlimited")
    with cli.session() as session:
        quota = crud.get_quota(session, tenant_id=acme)
        assert (quota.requests_per_min, quota.tokens_per_month, quota.max_rank) == (
            None, 1_000_000, 8,
        )  # fmt: skip
    assert cli.json("quotas", "show", "--tenant", "acme")["max_rank"] == 8
    assert "cannot be negative" in cli.fails(
        "quotas", "set", "--tenant", "acme", "--max-rank", "-1"
    )
    assert "no limit given" in cli.fails("quotas", "set", "--tenant", "acme")


def test_adapters_list_across_tenants(cli, acme):
    beta = cli.json("tenants", "create", "beta")["id"]
    with cli.session() as session:
        for tenant_id, name in ((acme, "pirate"), (beta, "pirate"), (beta, "poet")):
            crud.create_adapter(
                session, tenant_id=tenant_id, name=name, base_model="tiny", rank=8, alpha=16,
                targets="q_proj,v_proj", bytes=1234, sha256="ab" * 32, storage_key="ab" * 32,
            )  # fmt: skip
    rows = cli.json("adapters", "list")
    assert [(r["tenant"], r["name"]) for r in rows] == [
        ("acme", "pirate"), ("beta", "pirate"), ("beta", "poet"),
    ]  # fmt: skip
    assert "storage_key" not in rows[0]
    assert [r["name"] for r in cli.json("adapters", "list", "--tenant", "beta")] == [
        "pirate", "poet",
    ]  # fmt: skip
    table = cli.ok("adapters", "list", "--tenant", "acme")
    assert "pirate" in table and "poet" not in table and "q_proj,v_proj" in table


def _usage(session, tenant_id, request_id, prompt, completion, when):
    record_usage(
        session, request_id=request_id, tenant_id=tenant_id, model="tiny", status="ok",
        prompt_tokens=prompt, completion_tokens=completion, latency_ms=5.0, created_at=when,
    )  # fmt: skip


def test_usage_export_writes_billing_rows_for_the_period(cli, acme, tmp_path):
    beta = cli.json("tenants", "create", "beta", "--price-prompt", "2", "--price-completion", "3")
    with cli.session() as session:
        _usage(session, acme, "a1", 1000, 500, datetime(2024, 5, 1, tzinfo=UTC))
        _usage(session, acme, "a2", 1, 0, datetime(2024, 5, 31, 23, 59, tzinfo=UTC))
        _usage(session, beta["id"], "b1", 250, 750, datetime(2024, 5, 15, tzinfo=UTC))
        _usage(session, acme, "early", 10**6, 10**6, datetime(2024, 4, 30, 23, 59, tzinfo=UTC))
        _usage(session, acme, "late", 10**6, 10**6, datetime(2024, 6, 1, tzinfo=UTC))

    out_file = tmp_path / "may.csv"
    said = cli.ok("usage", "export", "--from", "2024-05-01", "--to", "2024-05-31",
                  "--format", "csv", "--output", str(out_file))  # fmt: skip
    assert "2024-05-01 to 2024-05-31" in said
    rows = {r["tenant"]: r for r in csv.DictReader(io.StringIO(out_file.read_text()))}
    assert rows.keys() == {"acme", "beta"}
    # 1001 prompt tokens at 0.0015/1k = 0.0015015 -> 0.001502 (half-up to 6 places).
    assert (rows["acme"]["prompt_tokens"], rows["acme"]["completion_tokens"]) == ("1001", "500")
    assert Decimal(rows["acme"]["cost"]) == Decimal("0.001502") + Decimal("0.001")
    assert Decimal(rows["beta"]["cost"]) == Decimal("0.5") + Decimal("2.25")

    as_json = json.loads(cli.ok("usage", "export", "--from", "2024-05-01", "--to", "2024-05-31",
                                "--format", "json"))  # fmt: skip
    assert {r["tenant"]: Decimal(r["cost"]) for r in as_json} == {
        "acme": Decimal("0.002502"), "beta": Decimal("2.75"),
    }  # fmt: skip
    assert as_json[0]["period_end"] == "2024-06-01T00:00:00+00:00"  # the end is exclusive

    summary = cli.json("usage", "summary", "--from", "2024-05-01", "--to", "2024-05-31",
                       "--group-by", "day", "--tenant", "acme")  # fmt: skip
    assert [(s["day"], s["requests"]) for s in summary] == [("2024-05-01", 1), ("2024-05-31", 1)]
    assert "empty period" in cli.fails(
        "usage", "export", "--from", "2024-06-01", "--to", "2024-05-01"
    )
    assert "--from" in cli.fails("usage", "export", "--from", "May")


def test_usage_summary_prints_a_table_for_every_group_by_its_help_offers(cli, acme):
    when = datetime(2024, 5, 2, tzinfo=UTC)
    with cli.session() as session:
        for request_id, version in [("v3a", 3), ("v3b", 3), ("v4", 4)]:
            record_usage(
                session, request_id=request_id, tenant_id=acme, model="sql", status="ok",
                prompt_tokens=10, completion_tokens=5, latency_ms=5.0, created_at=when,
                adapter_name="sql", adapter_version=version,
            )  # fmt: skip
        _usage(session, acme, "base", 7, 1, when)
    period = ("--from", "2024-05-01", "--to", "2024-05-31")
    for group_by in ("tenant", "adapter", "version", "day"):
        assert cli.ok("usage", "summary", *period, "--group-by", group_by) != "(none)\n"

    lines = cli.ok("usage", "summary", *period, "--group-by", "version").splitlines()
    assert lines[0].split()[:5] == ["TENANT", "ADAPTER", "VERSION", "REQUESTS", "PROMPT"]
    assert [line.split()[:4] for line in lines[1:]] == [
        ["acme", "(base)", "-", "1"], ["acme", "sql", "v3", "2"], ["acme", "sql", "v4", "1"],
    ]  # fmt: skip


def test_usage_errors_are_one_line_with_exit_code_2(cli):
    assert "invalid choice" in cli.fails("usage", "export", "--format", "xml")
    assert "--tenant" in cli.fails("keys", "create")


def test_adapter_versions_promote_split_rollback_delete(cli, acme):
    with cli.session() as session:
        for n in (1, 2, 3):
            crud.create_adapter(
                session, tenant_id=acme, name="sql", base_model="tiny", rank=4 * n, alpha=8,
                targets="q_proj", bytes=100 * n, sha256=f"{n}" * 64, storage_key=f"{n}" * 64,
            )  # fmt: skip
    rows = cli.json("adapters", "list", "--tenant", "acme")
    assert [(r["version"], r["aliases"]) for r in rows] == [(1, ["default"]), (2, []), (3, [])]
    header, *lines = cli.ok("adapters", "list").splitlines()
    assert header.split()[:4] == ["TENANT", "NAME", "VERSION", "ALIASES"]
    assert lines[0].split()[:4] == ["acme", "sql", "v1", "default"]

    assert cli.ok("adapters", "promote", "acme", "sql", "v2").strip() == (
        "sql@default -> v2 100 (was v1 100)"
    )
    said = cli.json("adapters", "split", "acme", "sql", "v2=90", "3=10")
    assert (said["weights"], said["previous"]) == ({"v2": 90, "v3": 10}, {"v2": 100})
    assert [r["aliases"] for r in cli.json("adapters", "list")] == [[], ["default"], ["default"]]
    assert "default 10%" in cli.ok("adapters", "list", "--tenant", "acme")
    table = cli.ok("adapters", "versions", "acme", "sql")
    assert "default 90%" in table and "default 10%" in table and "v2 90, v3 10" in table
    shown = cli.json("adapters", "versions", str(acme), "sql")
    assert [(v["version"], v["aliases"], v["rank"]) for v in shown["versions"]] == [
        (1, [], 4), (2, ["default"], 8), (3, ["default"], 12),
    ]  # fmt: skip
    assert "v2 100 (was v2 90, v3 10)" in cli.ok("adapters", "rollback", "acme", "sql")

    err = cli.fails("adapters", "delete-version", "acme", "sql", "v2")
    assert "in use by alias default" in err
    assert "deleted sql@v1" in cli.ok("adapters", "delete-version", "acme", "sql", "v1")
    assert "no version v1" in cli.fails("adapters", "promote", "acme", "sql", "v1")
    assert "VERSION=WEIGHT" in cli.fails("adapters", "split", "acme", "sql", "v2:50")
    assert "above 0" in cli.fails("adapters", "split", "acme", "sql", "v2=0")
    assert "no alias 'canary'" in cli.fails(
        "adapters", "rollback", "acme", "sql", "--alias", "canary"
    )
    assert "no adapter named 'nope'" in cli.fails("adapters", "versions", "acme", "nope")
    with cli.session() as session:
        assert [a.version for a in crud.list_adapters(session, tenant_id=acme)] == [2, 3]
