"""Two `loraplex serve` processes on one PostgreSQL database and one S3 endpoint (moto's
server), as the Helm chart runs them: what one replica changes, the other sees at once, and
limits and the ledger hold for the fleet, not per replica."""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import time
from datetime import UTC, datetime

import boto3
import httpx
import pytest
from sqlalchemy import func, select

from loraplex.platform.db.models import UsageRecord
from loraplex.platform.db.session import make_engine, make_sessionmaker
from tests.platform.conftest import _empty_pg_schema
from tests.utils.factories import make_adapter
from tests.utils.fleet import complete, new_tenant, received_usage
from tests.utils.moto import ACCESS_KEY, REGION, SECRET_KEY, free_port, moto_server
from tests.utils.server import ADMIN_KEY
from tests.utils.uploads import auth, folder_parts, upload

pytestmark = pytest.mark.slow
BUCKET = "fleet-adapters"


def _env(common: dict[str, str], data_dir, port: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(common, LORAPLEX_DATA_DIR=str(data_dir))
    if port is not None:
        env["LORAPLEX_PORT"] = str(port)
    return env


def _wait_ready(urls: list[str], procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline, waiting = time.monotonic() + timeout, set(urls)
    while waiting and time.monotonic() < deadline:
        for url, proc in zip(urls, procs, strict=True):
            assert proc.poll() is None, f"the replica at {url} exited with {proc.returncode}"
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    waiting.discard(url)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    assert not waiting, f"not ready after {timeout}s: {sorted(waiting)}"


@pytest.fixture(scope="module")
def replicas(tiny_models, pg_database_url, tmp_path_factory):
    """(url of A, url of B, sessions on the shared database, adapter folders)."""
    root = tmp_path_factory.mktemp("replicas")
    _empty_pg_schema(pg_database_url)
    with moto_server() as s3_url:
        boto3.client("s3", endpoint_url=s3_url, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                     aws_secret_access_key=SECRET_KEY).create_bucket(Bucket=BUCKET)  # fmt: skip
        common = dict(
            LORAPLEX_DATABASE_URL=pg_database_url,
            LORAPLEX_STORE_URL=f"s3://{BUCKET}/fleet",
            LORAPLEX_S3_ENDPOINT_URL=s3_url,
            LORAPLEX_S3_REGION=REGION,
            LORAPLEX_AWS_ACCESS_KEY_ID=ACCESS_KEY,
            LORAPLEX_AWS_SECRET_ACCESS_KEY=SECRET_KEY,
            LORAPLEX_MODEL=str(tiny_models["llama"]),
            LORAPLEX_ADMIN_KEY=ADMIN_KEY,
            LORAPLEX_DTYPE="float32",
            LORAPLEX_MAX_MODEL_LEN="256",
            LORAPLEX_ENGINE_THREADS="1",
            LORAPLEX_ENGINE_PROCESS="false",
            LORAPLEX_HOST="127.0.0.1",
        )
        cli = [sys.executable, "-m", "loraplex.platform.cli"]
        # Migrations run once, by the operator's `db upgrade`; replicas on a shared database
        # only check the schema.
        subprocess.run([*cli, "db", "upgrade"], env=_env(common, root / "migrate"), check=True,
                       capture_output=True, timeout=60)  # fmt: skip
        ports = [free_port(), free_port()]
        procs = [
            subprocess.Popen(
                [*cli, "serve", "--log-level", "warning"],
                env=_env(common, root / f"replica-{i}", port),
            )  # fmt: skip
            for i, port in enumerate(ports)
        ]
        db = make_engine(pg_database_url)
        try:
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            _wait_ready(urls, procs)
            folders = {name: make_adapter(tiny_models["llama"], root / name, r=4, seed=seed)
                       for name, seed in (("x", 1), ("y", 2))}  # fmt: skip
            yield urls[0], urls[1], make_sessionmaker(db), folders
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            db.dispose()


def test_what_replica_a_changes_replica_b_sees_at_once(replicas):
    a, b, _, folders = replicas
    _, key_id, key = new_tenant(a, "propagation")
    base = complete(b, key, "llama").json()["choices"][0]["text"]

    assert upload(a, key, "x", folder_parts(folders["x"])).status_code == 201
    uploaded = time.monotonic()
    on_b = complete(b, key, "x")
    served_after = time.monotonic() - uploaded
    assert on_b.status_code == 200, on_b.text
    text_b = on_b.json()["choices"][0]["text"]
    assert text_b == complete(a, key, "x").json()["choices"][0]["text"] != base

    deleted = httpx.delete(f"{a}/v1/adapters/x", headers=auth(key), timeout=30)
    assert deleted.status_code == 200, deleted.text
    gone = time.monotonic()
    refused = complete(b, key, "x")
    refused_after = time.monotonic() - gone
    assert refused.status_code == 404, refused.text  # B still has its bytes on disk
    assert refused.json()["error"]["code"] == "model_not_found"

    revoked = httpx.post(f"{a}/admin/api/keys/{key_id}/revoke", headers=auth(ADMIN_KEY))
    assert revoked.status_code == 200, revoked.text
    t = time.monotonic()
    locked_out = complete(b, key, "llama")
    revoked_after = time.monotonic() - t
    assert locked_out.status_code == 401, locked_out.text
    print(f"upload on A -> served by B in {served_after:.3f}s (first request, incl. the S3 "
          f"fetch); delete on A -> 404 on B in {refused_after:.3f}s; revoke on A -> 401 on B "
          f"in {revoked_after:.3f}s")  # fmt: skip


def test_a_requests_per_min_cap_holds_across_replicas(replicas):
    a, b, sessions, _ = replicas
    cap, sent = 6, 16
    tenant_id, _, key = new_tenant(a, "capped", quota={"requests_per_min": cap})
    now = datetime.now(UTC)
    if now.second >= 50:  # the burst must fall in one counter minute
        time.sleep(60.5 - now.second - now.microsecond / 1e6)
    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: complete((a, b)[i % 2], key, "llama", max_tokens=1),
                                  range(sent)))  # fmt: skip
    codes = [r.status_code for r in responses]
    admitted = codes.count(200)
    print(f"requests_per_min={cap}: {sent} concurrent to 2 replicas -> {admitted} admitted "
          f"(A {codes[0::2].count(200)}, B {codes[1::2].count(200)}), overshoot "
          f"{admitted - cap}")  # fmt: skip
    assert admitted == cap and codes.count(429) == sent - cap, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1
    with sessions() as session:
        billed = session.scalar(select(func.count()).where(UsageRecord.tenant_id == tenant_id))
    assert billed == cap  # refused requests leave no usage record


def test_usage_ledger_equals_what_clients_received_across_replicas(replicas):
    a, b, sessions, folders = replicas
    tenant_id, _, key = new_tenant(a, "metered")
    assert upload(b, key, "y", folder_parts(folders["y"])).status_code == 201
    jobs = [(url, model, stream) for url in (a, b) for model in ("y", "llama")
            for stream in (False, True)] * 3  # fmt: skip
    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda j: complete(j[0], key, j[1], max_tokens=6,
                                                     stream=j[2]), jobs))  # fmt: skip
    assert [r.status_code for r in responses] == [200] * len(jobs), [r.text for r in responses]
    received = {rid: (p, c) for rid, p, c in map(received_usage, responses)}
    with sessions() as session:
        rows = session.execute(
            select(UsageRecord.request_id, UsageRecord.prompt_tokens,
                   UsageRecord.completion_tokens).where(UsageRecord.tenant_id == tenant_id)
        ).all()  # fmt: skip
    ledger = {rid: (p, c) for rid, p, c in rows}
    assert ledger == received
    print(f"ledger across 2 replicas: {len(ledger)} records, "
          f"{sum(c for _, c in ledger.values())} completion tokens = received")  # fmt: skip
