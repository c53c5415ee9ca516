"""A real loraplex server on 127.0.0.1 in a thread of this process, and a tenant's upload: what
the tests (tests/utils/server.py's `run_server`) and the lab (benchmarks/stalled_stream.py,
benchmarks/dataplane.py) both start servers with."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ADMIN_KEY = "test-admin-key-" + "x" * 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout_s: float, what: str = "the server",
               every_s: float = 0.1, check=None) -> None:  # fmt: skip
    """Poll `url` until it answers 200; RuntimeError after `timeout_s`. `check()` runs before
    each poll (a started process' exit, say) and may raise first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check is not None:
            check()
        try:
            if httpx.get(url, timeout=max(1.0, every_s * 4)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} at {url} did not become ready in {timeout_s} s")
        time.sleep(every_s)


@contextmanager
def serve_in_thread(settings, timeout_s: float = 120) -> Iterator[tuple[object, str]]:
    """(app, url) of a server on `settings` running in a thread of this process, with the
    listening socket `loraplex serve` makes (its send buffer bounds streams); stopped on exit.
    For the tests' `run_server` and the lab, which need the app's state at hand."""
    import threading

    import uvicorn

    from loraplex.platform.cli import serve_socket
    from loraplex.platform.db.session import upgrade
    from loraplex.platform.main import create_app

    upgrade(settings.database_url)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level="warning", loop="asyncio"))  # fmt: skip
    sock = serve_socket(server.config, settings.stream_send_buffer_bytes)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://{settings.host}:{settings.port}"
    try:
        wait_ready(f"{url}/readyz", timeout_s)
        yield app, url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def upload_adapter(url: str, key: str, name: str, folder: Path) -> httpx.Response:
    """POST /v1/adapters with a PEFT folder's two files, as a tenant's client would."""
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())
             if p.name in ("adapter_config.json", "adapter_model.safetensors")]  # fmt: skip
    return httpx.post(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {key}"},
                      data={"name": name}, files=files, timeout=60)  # fmt: skip
