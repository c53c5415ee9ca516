"""A batch survives SIGKILLs of its server: `loraplex serve` processes on PostgreSQL and a moto
S3 store, killed at drawn points mid-batch (new ones each run); the restarted server resumes
the batch once the dead one's lease runs out, and every line is answered exactly once. The
last server must run exactly the lines that had no answer when the previous one died (its
request counter says so): no finished line runs twice, none is lost."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import pytest
from sqlalchemy import make_url, select

from loraplex.platform.db import crud
from loraplex.platform.db.models import BatchLine, UsageRecord
from loraplex.platform.db.session import make_engine, make_sessionmaker
from testkit.factories import make_adapter
from tests.platform.conftest import PG_SERVER, _pg_admin_connect
from tests.utils.moto import free_port
from tests.utils.replicas import fleet_settings
from tests.utils.server import upload_adapter

LINES = 24
KILLS = 1  # each costs a server start; the kill points are drawn anew each run
CLI = [sys.executable, "-m", "loraplex.platform.cli"]


@pytest.fixture
def pg_url():
    """A database of its own: the fleet tests' servers keep theirs for the whole package."""
    admin = _pg_admin_connect()
    name = f"loraplex_batch_{os.getpid()}_{random.randrange(1 << 30)}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        url = make_url(PG_SERVER).set(username=admin.info.user, database=name,
                                      drivername="postgresql")  # fmt: skip
        yield url.render_as_string(hide_password=False)
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@contextmanager
def environment(model_dir, pg_url, root):
    with fleet_settings(model_dir, pg_url, "batches", "store") as common:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        env.update(
            common,
            LORAPLEX_DATA_DIR=str(root),
            LORAPLEX_BATCH_LEASE_S="2",
            LORAPLEX_BATCH_POLL_INTERVAL_S="0.2",
            LORAPLEX_BATCH_CONCURRENCY="3",
        )
        subprocess.run([*CLI, "db", "upgrade"], env=env, check=True, capture_output=True,
                       timeout=60)  # fmt: skip
        yield env


def start(env) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--log-level", "warning"],
                            env={**env, "LORAPLEX_PORT": str(port)})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not get ready"
        time.sleep(0.2)


def answered(sessions, batch_id: str) -> set[int]:
    with sessions() as session:
        return set(session.scalars(select(BatchLine.line).where(BatchLine.batch_id == batch_id)))


def test_a_batch_survives_sigkills_with_every_line_answered_once(tiny_models, tmp_path, pg_url):
    rng = random.Random()
    seed = rng.randrange(1 << 16)
    rng.seed(seed)
    db = make_engine(pg_url)
    procs: list[subprocess.Popen] = []
    try:
        with environment(tiny_models["llama"], pg_url, tmp_path) as env:
            sessions = make_sessionmaker(db)
            with sessions() as session:
                tenant = crud.create_tenant(session, name="durable")
                key, _ = crud.create_key(session, tenant_id=tenant.id)
            proc, url = start(env)
            procs.append(proc)
            folder = tmp_path / "adapter"
            make_adapter(tiny_models["llama"], folder, r=4, seed=3)
            assert upload_adapter(url, key, "ad", folder).status_code == 201
            items = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"model": "ad" if i % 2 else "llama", "prompt": f"tale {i}",
                               "max_tokens": 8, "ignore_eos": True}}
                     for i in range(LINES)]  # fmt: skip
            headers = {"Authorization": f"Bearer {key}"}
            data = "".join(json.dumps(x) + "\n" for x in items).encode()
            r = httpx.post(f"{url}/v1/files", headers=headers, data={"purpose": "batch"},
                           files={"file": ("in.jsonl", data)})  # fmt: skip
            assert r.status_code == 200, r.text
            r = httpx.post(f"{url}/v1/batches", headers=headers,
                           json={"input_file_id": r.json()["id"], "endpoint": "/v1/completions",
                                 "completion_window": "24h"})  # fmt: skip
            batch_id = r.json()["id"]
            # Each kill at a drawn number of finished lines, in its own part of the batch.
            part = (LINES - 4) // KILLS
            for k in range(KILLS):
                target = rng.randrange(2 + k * part, 2 + (k + 1) * part)
                deadline = time.monotonic() + 120
                while len(answered(sessions, batch_id)) < target:
                    assert time.monotonic() < deadline, f"stuck (seed {seed})"
                    time.sleep(0.05)
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                before = answered(sessions, batch_id)  # nothing answers until a restart
                proc, url = start(env)
                procs.append(proc)
            # That server runs only what had no answer when the last one died.
            deadline = time.monotonic() + 180
            while (b := httpx.get(f"{url}/v1/batches/{batch_id}", headers=headers).json())[
                "status"
            ] != "completed":
                assert time.monotonic() < deadline, f"not completed: {b} (seed {seed})"
                time.sleep(0.2)
            metrics = httpx.get(f"{url}/metrics").text
            ran = sum(float(m) for m in re.findall(
                r'loraplex_requests_total\{route="completions",status="\w+"\} ([\d.e+]+)',
                metrics))  # fmt: skip
            assert ran == LINES - len(before), (ran, LINES, len(before), seed)
            assert b["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
            out = httpx.get(f"{url}/v1/files/{b['output_file_id']}/content", headers=headers)
            ids = [json.loads(x)["custom_id"] for x in out.text.splitlines()]
            assert sorted(ids) == sorted(x["custom_id"] for x in items)  # each exactly once
            with sessions() as session:
                billed = session.scalars(
                    select(UsageRecord).where(UsageRecord.request_id.like(f"{batch_id}-%"))
                ).all()
            assert {r.request_id for r in billed} == {f"{batch_id}-{i}" for i in range(LINES)}
            assert all(r.request_class == "batch" for r in billed)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        db.dispose()
