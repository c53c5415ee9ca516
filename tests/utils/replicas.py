"""Two `loraplex serve` processes on one PostgreSQL database and one S3 endpoint (moto's
server), as the Helm chart runs them (the `replicas` fixture in tests/platform/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import boto3
import httpx

from loraplex.platform.db.session import make_engine, make_sessionmaker
from loraplex.platform.store import AdapterStore, make_store
from testkit.factories import make_adapter
from tests.utils.moto import ACCESS_KEY, REGION, SECRET_KEY, free_port, moto_server
from tests.utils.server import ADMIN_KEY

BUCKET = "fleet-adapters"


class Replicas(NamedTuple):
    a: str
    b: str
    sessions: Any
    folders: dict[str, Path]
    store: AdapterStore


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


@contextmanager
def fleet_settings(model_dir: Path, pg_database_url: str, bucket: str, prefix: str
                   ) -> Iterator[dict[str, str]]:  # fmt: skip
    """A new moto server holding `bucket`, and the settings every server process of one fleet
    shares: the PostgreSQL database, the store under s3://bucket/prefix, the tiny model."""
    with moto_server() as s3_url:
        boto3.client("s3", endpoint_url=s3_url, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                     aws_secret_access_key=SECRET_KEY).create_bucket(Bucket=bucket)  # fmt: skip
        yield dict(
            LORAPLEX_DATABASE_URL=pg_database_url,
            LORAPLEX_STORE_URL=f"s3://{bucket}/{prefix}",
            LORAPLEX_S3_ENDPOINT_URL=s3_url,
            LORAPLEX_S3_REGION=REGION,
            LORAPLEX_AWS_ACCESS_KEY_ID=ACCESS_KEY,
            LORAPLEX_AWS_SECRET_ACCESS_KEY=SECRET_KEY,
            LORAPLEX_MODEL=str(model_dir),
            LORAPLEX_ADMIN_KEY=ADMIN_KEY,
            LORAPLEX_DTYPE="float32",
            LORAPLEX_MAX_MODEL_LEN="256",
            LORAPLEX_ENGINE_THREADS="1",
            LORAPLEX_ENGINE_PROCESS="false",
            LORAPLEX_HOST="127.0.0.1",
            LORAPLEX_REPLICA_HEARTBEAT_S="0.5",  # each sees the other's within a second
        )


@contextmanager
def start_replicas(model_dir: Path, pg_database_url: str, root: Path) -> Iterator[Replicas]:
    """Two replicas on a PostgreSQL database and a new moto server: (url of A, url of
    B, sessions on the shared database, adapter folders x and y, the store)."""
    with fleet_settings(model_dir, pg_database_url, BUCKET, "fleet") as common:
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
            folders = {name: make_adapter(model_dir, root / name, r=4, seed=seed)
                       for name, seed in (("x", 1), ("y", 2))}  # fmt: skip
            store = make_store(common["LORAPLEX_STORE_URL"],
                               endpoint_url=common["LORAPLEX_S3_ENDPOINT_URL"], region=REGION,
                               access_key=ACCESS_KEY, secret_key=SECRET_KEY)  # fmt: skip
            yield Replicas(urls[0], urls[1], make_sessionmaker(db), folders, store)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            db.dispose()
