"""Run moto's standalone S3 server as a real process on 127.0.0.1: the tests' S3 over HTTP and
`python -m benchmarks.fleet_store --store moto`'s. Needs `moto[server]` (the test extra)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.server import stop_process

# moto ignores credentials unless auth is switched on; any non-empty pair signs requests.
ACCESS_KEY, SECRET_KEY, REGION = "testing", "testing", "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_server(*, auth: bool = False, timeout: float = 30.0) -> Iterator[str]:
    """Start `python -m moto.server` on a free port; yields its endpoint URL.

    `auth=True` makes the server check credentials (only its built-in test keys pass), so
    requests with made-up keys get a real 403 `InvalidAccessKeyId`.
    """
    env = dict(os.environ)
    if auth:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    for _attempt in range(3):  # another process may grab the port between probe and bind
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                direct.open(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        if proc.poll() is None and time.monotonic() < deadline:
            break
        proc.kill()
        proc.wait()
    else:
        raise RuntimeError("moto server did not start (is moto[server] installed?)")
    try:
        yield url
    finally:
        stop_process(proc, timeout_s=10)
