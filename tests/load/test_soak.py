"""Load and faults at a tenant's scale, against real servers: concurrent streams with clients
hanging up, quotas hit by bursts, adapters deleted under traffic, SIGTERM and a killed engine.

Each scenario asserts what a user must be able to rely on (no 5xx, no lost or hung request,
a usage ledger equal to what clients received) and records its figures (conftest.py).
`LORAPLEX_SOAK=full` runs the full size; `scripts/soak.py` does that and prints the table.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from loraplex.platform.db import crud
from loraplex.platform.db.models import UsageRecord
from loraplex.platform.db.session import make_engine, make_sessionmaker, upgrade
from testkit.factories import make_adapter
from tests.platform.test_faults import _engine_child
from tests.platform.test_quickstart import Serve
from tests.utils.server import ADMIN_KEY, run_server, upload_adapter
from tests.utils.sse_client import StreamResult, stream_completion

TARGETS = [("q_proj", "v_proj"), ("k_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")]
HUNG_TIMEOUT_S = 180  # a request still open after this is "hung"


def _adapter_folders(base: Path, root: Path, n: int) -> list[Path]:
    return [
        make_adapter(base, root / f"a{j}", r=(4, 8)[j % 2], targets=TARGETS[j % 3], seed=100 + j)
        for j in range(n)
    ]


def _wait_idle(state, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while state.inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not state.inflight, f"requests still in flight: {state.inflight}"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory, soak_database):
    overrides = {"database_url": soak_database} if soak_database else {}
    with run_server(
        tiny_models["llama"], tmp_path_factory.mktemp("soak"), max_loras=8, **overrides
    ) as srv:
        yield srv


def _unique(name: str) -> str:
    return f"{name}-{secrets.token_hex(3)}"


# --------------------------------------------------------------------------- streams


def test_concurrent_streams_with_hang_ups_keep_the_ledger_exact(
    server, tiny_models, tmp_path, soak_size, record
):
    n, max_tokens = soak_size["streams"], soak_size["max_tokens"]
    tenants = [server.new_tenant(_unique(f"soak{i}")) for i in range(soak_size["tenants"])]
    owned: dict[int, list[str]] = defaultdict(list)
    for j, folder in enumerate(
        _adapter_folders(tiny_models["llama"], tmp_path, soak_size["adapters"])
    ):
        t = j % len(tenants)
        assert upload_adapter(server.url, tenants[t][1], f"a{j}", folder).status_code == 201
        owned[t].append(f"a{j}")
    rng = random.Random(7)
    plan = []
    for i in range(n):
        t = i % len(tenants)
        model = rng.choice([*owned[t], server.state.model_name])
        hang_up = rng.randint(1, max_tokens - 2) if i % 3 == 0 else None
        plan.append((t, model, hang_up))
    body = {
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": 1,
        "logprobs": 0,
        "ignore_eos": True,
    }

    async def one(i, t, model, hang_up):
        return await asyncio.wait_for(
            stream_completion(
                server.url,
                tenants[t][1],
                {**body, "model": model, "prompt": f"request {i} of the soak"},
                hang_up_after=hang_up,
            ),
            HUNG_TIMEOUT_S,
        )

    async def main():
        return await asyncio.gather(
            *(one(i, *p) for i, p in enumerate(plan)), return_exceptions=True
        )

    start = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - start
    failures = [r for r in results if not isinstance(r, StreamResult)]
    assert not failures, failures[:3]  # none hung (TimeoutError), none broke
    assert [r.status for r in results] == [200] * n  # 0 x 5xx, 0 x anything else
    assert all(
        r.finished and r.tokens == max_tokens and r.error is None
        for r, p in zip(results, plan, strict=True)
        if p[2] is None
    )
    _wait_idle(server.state)
    by_tenant_sent: dict[int, int] = defaultdict(int)
    for r, (t, _, _) in zip(results, plan, strict=True):
        by_tenant_sent[tenants[t][0]] += r.tokens
    with server.sessions() as session:
        rows = {
            r.request_id: r
            for r in session.scalars(
                select(UsageRecord).where(UsageRecord.tenant_id.in_([t[0] for t in tenants]))
            )
        }
    assert len(rows) == n and {r.request_id for r in results} == set(rows)
    mismatched = [
        (r.request_id, r.tokens, rows[r.request_id].completion_tokens)
        for r in results
        if rows[r.request_id].completion_tokens != r.tokens
    ]
    assert not mismatched, mismatched[:5]
    ledger: dict[int, int] = defaultdict(int)
    for row in rows.values():
        ledger[row.tenant_id] += row.completion_tokens
    assert ledger == by_tenant_sent
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for tenant_id, _ in tenants:
        bill = httpx.get(
            f"{server.url}/admin/api/billing", params={"tenant_id": tenant_id}, headers=admin
        ).json()["data"]
        assert len(bill) == 1 and bill[0]["completion_tokens"] == ledger[tenant_id]
        assert bill[0]["requests"] == sum(1 for r in rows.values() if r.tenant_id == tenant_id)
    hung_up = [r for r, p in zip(results, plan, strict=True) if p[2] is not None]
    record(
        "streams",
        requests=n,
        tenants=len(tenants),
        adapters=soak_size["adapters"],
        hung_up=len(hung_up),
        cut_short=sum(not r.finished for r in hung_up),
        tokens_sent=sum(by_tenant_sent.values()),
        ledger_mismatches=0,
        non_200=0,
        seconds=round(elapsed, 1),
        database="postgresql" if server.settings.database_url.startswith("postgres") else "sqlite",
    )


# --------------------------------------------------------------------------- quotas


def _wait_for_a_fresh_minute() -> None:
    """Per-minute counters reset on the UTC minute: keep a burst inside one."""
    second = datetime.now(UTC).second + datetime.now(UTC).microsecond / 1e6
    if second > 45:
        time.sleep(60.5 - second)


async def _burst(url: str, key: str, model: str, count: int, max_tokens: int):
    async with httpx.AsyncClient(timeout=HUNG_TIMEOUT_S) as client:
        body = {"model": model, "prompt": "quota", "max_tokens": max_tokens, "ignore_eos": True}
        return await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
                for _ in range(count)
            )
        )


def test_quotas_hold_under_concurrent_bursts(server, soak_size, record):
    cap = 8
    _, key = server.new_tenant(_unique("rpm"), requests_per_min=cap)
    _wait_for_a_fresh_minute()
    answers = asyncio.run(
        _burst(server.url, key, server.state.model_name, soak_size["burst"] * cap, 2)
    )
    statuses = [r.status_code for r in answers]
    assert statuses.count(200) == cap, statuses
    assert statuses.count(429) == len(answers) - cap
    assert all(int(r.headers["retry-after"]) >= 1 for r in answers if r.status_code == 429)

    max_tokens = 8
    prompt_tokens = len(server.state.engine.tokenizer.encode("quota"))
    estimate = prompt_tokens + max_tokens
    budget = 6 * estimate + estimate // 2  # room for 6 requests and a half
    t_id, t_key = server.new_tenant(_unique("tpm"), tokens_per_min=budget)
    _wait_for_a_fresh_minute()
    answers = asyncio.run(
        _burst(server.url, t_key, server.state.model_name, soak_size["burst"] * 6, max_tokens)
    )
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 429}, statuses
    _wait_idle(server.state)
    with server.sessions() as session:
        used = sum(
            r.prompt_tokens + r.completion_tokens
            for r in session.scalars(select(UsageRecord).where(UsageRecord.tenant_id == t_id))
        )
    # Each request reserves prompt + max_tokens before it runs: the cap can never be passed,
    # and as many requests as fit are admitted.
    overshoot = used - budget
    assert overshoot <= 0 and statuses.count(200) == budget // estimate, (used, statuses)
    record(
        "quotas",
        requests_per_min=cap,
        burst=soak_size["burst"] * cap,
        admitted=cap,
        tokens_per_min=budget,
        token_burst=len(statuses),
        token_admitted=statuses.count(200),
        tokens_used=used,
        overshoot_tokens=max(0, overshoot),
    )


# --------------------------------------------------------------------------- adapter churn


def test_deleting_and_reuploading_an_adapter_under_traffic(
    server, tiny_models, tmp_path, soak_size, record
):
    _, key = server.new_tenant(_unique("churn"))
    folders = _adapter_folders(tiny_models["llama"], tmp_path, 2)
    assert upload_adapter(server.url, key, "churn", folders[0]).status_code == 201
    statuses: list[int] = []
    churn: list[tuple[str, int]] = []

    async def traffic():
        async with httpx.AsyncClient(timeout=HUNG_TIMEOUT_S) as client:
            body = {"model": "churn", "prompt": "race", "max_tokens": 4, "ignore_eos": True}
            for _ in range(soak_size["races"]):
                r = await client.post(
                    f"{server.url}/v1/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                )
                statuses.append(r.status_code)
                if r.status_code != 200:
                    assert r.json()["error"]["code"] == "model_not_found", r.text

    async def deletes_and_uploads():
        for i in range(6):
            await asyncio.sleep(0.05)
            r = await asyncio.to_thread(
                httpx.delete,
                f"{server.url}/v1/adapters/churn",
                headers={"Authorization": f"Bearer {key}"},
            )
            churn.append(("delete", r.status_code))
            await asyncio.sleep(0.05)
            r = await asyncio.to_thread(
                upload_adapter, server.url, key, "churn", folders[(i + 1) % 2]
            )
            churn.append(("upload", r.status_code))

    async def main():
        await asyncio.gather(traffic(), traffic(), deletes_and_uploads())

    asyncio.run(main())
    assert set(statuses) <= {200, 404}, statuses  # old weights, new weights or "no such model"
    assert {s for op, s in churn if op == "delete"} <= {200, 204}, churn
    assert {s for op, s in churn if op == "upload"} == {201}, churn
    record(
        "adapter_churn",
        requests=len(statuses),
        ok=statuses.count(200),
        not_found=statuses.count(404),
        deletes=len(churn) // 2,
        server_errors=0,
    )


# --------------------------------------------------------------------------- process faults


def _serve_with_tenant(tmp_path: Path, tiny_models, soak_database, env: dict) -> tuple:
    """`loraplex serve` in its own process on the suite's database; (serve, sessions, key)."""
    env = {"LORAPLEX_MAX_MODEL_LEN": "512", **env}
    if soak_database:
        upgrade(soak_database)  # a shared database is migrated by `db upgrade`, not by serve
        env["LORAPLEX_DATABASE_URL"] = soak_database
        env["LORAPLEX_ADMIN_KEY"] = ADMIN_KEY
    serve = Serve(tmp_path, "--model", str(tiny_models["llama"]), env=env)
    serve.wait_ready()
    db = make_engine(soak_database or f"sqlite:///{tmp_path / 'loraplex.db'}")
    sessions = make_sessionmaker(db)
    with sessions() as session:
        tenant = crud.create_tenant(session, name=_unique("proc"))
        secret, _ = crud.create_key(session, tenant_id=tenant.id)
    return serve, sessions, tenant.id, secret, db


def _billed_as_received(sessions, db, tenant_id: int, results, status: str) -> dict:
    """One ledger row per stream, billing exactly what its client received, with `status`."""
    rows = _ledger(sessions, tenant_id)
    db.dispose()
    assert {r.request_id for r in results} == set(rows)
    wrong = [(r.request_id, r.tokens, rows[r.request_id].completion_tokens,
              rows[r.request_id].status) for r in results
             if rows[r.request_id].completion_tokens != r.tokens
             or rows[r.request_id].status != status]  # fmt: skip
    assert not wrong, wrong[:5]
    return rows


def _ledger(sessions, tenant_id: int) -> dict[str, UsageRecord]:
    with sessions() as session:
        return {
            r.request_id: r
            for r in session.scalars(select(UsageRecord).where(UsageRecord.tenant_id == tenant_id))
        }


async def _streams_then(url, key, count, max_tokens, when_all_started):
    started: set[int] = set()
    fired = asyncio.Event()

    def progress(i):
        def seen(_tokens: int) -> None:
            started.add(i)
            if len(started) == count and not fired.is_set():
                fired.set()
                when_all_started()

        return seen

    body = {
        "model": "llama",
        "max_tokens": max_tokens,
        "logprobs": 0,
        "ignore_eos": True,
        "temperature": 0,
    }
    tasks = [
        asyncio.wait_for(
            stream_completion(url, key, {**body, "prompt": f"fault {i}"}, on_tokens=progress(i)),
            HUNG_TIMEOUT_S,
        )
        for i in range(count)
    ]
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_sigterm_under_load_finishes_inflight_streams(
    tmp_path, tiny_models, soak_database, soak_size, record
):
    serve, sessions, tenant_id, key, db = _serve_with_tenant(
        tmp_path, tiny_models, soak_database, {"LORAPLEX_SHUTDOWN_GRACE_S": "120"}
    )
    count, max_tokens = soak_size["fault_streams"], 96
    refused_after: list[bool] = []
    try:

        def sigterm() -> None:
            serve.proc.send_signal(signal.SIGTERM)

        start = time.monotonic()
        results = asyncio.run(_streams_then(serve.url, key, count, max_tokens, sigterm))
        try:  # a new request once shutdown has begun gets no answer
            httpx.get(f"{serve.url}/readyz", timeout=2).raise_for_status()
            refused_after.append(False)
        except httpx.HTTPError:
            refused_after.append(True)
        serve.assert_clean_exit(signal.SIGTERM, timeout=150)
        assert serve.proc.returncode == 0
        elapsed = time.monotonic() - start
    finally:
        serve.close()
    assert all(isinstance(r, StreamResult) for r in results), results[:3]
    assert all(r.finished and r.error is None and r.tokens == max_tokens for r in results)
    assert refused_after == [True]
    rows = _billed_as_received(sessions, db, tenant_id, results, "ok")
    record(
        "sigterm",
        streams=count,
        finished=count,
        tokens_each=max_tokens,
        ledger_rows=len(rows),
        seconds_to_exit=round(elapsed, 1),
    )


def test_engine_killed_under_load_ends_streams_and_the_server(
    tmp_path, tiny_models, soak_database, soak_size, record
):
    serve, sessions, tenant_id, key, db = _serve_with_tenant(
        tmp_path, tiny_models, soak_database, {}
    )
    count = soak_size["fault_streams"]
    killed_at: list[float] = []
    try:
        child = _engine_child(serve.proc.pid)

        def kill() -> None:
            os.kill(child, signal.SIGKILL)
            killed_at.append(time.monotonic())

        results = asyncio.run(_streams_then(serve.url, key, count, 400, kill))
        rc = serve.proc.wait(60)
        exit_s = time.monotonic() - killed_at[0]
    finally:
        serve.close()
    assert rc == 3
    assert all(isinstance(r, StreamResult) for r in results), results[:3]
    assert all(r.finished and r.error and r.error["code"] == "engine_unavailable" for r in results)
    _billed_as_received(sessions, db, tenant_id, results, "error")
    record(
        "engine_sigkill",
        streams=count,
        ended_with_error_event=count,
        exit_code=rc,
        seconds_to_exit=round(exit_s, 1),
        tokens_billed=sum(r.tokens for r in results),
    )
