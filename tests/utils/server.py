"""A real loraplex server on 127.0.0.1 for API tests (uvicorn in a background thread)."""

from __future__ import annotations

import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks.server import serve_in_thread
from loraplex.platform.db import crud
from loraplex.platform.db.session import make_engine, make_sessionmaker
from loraplex.platform.settings import Settings

ADMIN_KEY = "test-admin-key-" + "x" * 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    settings: Settings
    app: object
    sessions: object

    @property
    def state(self):
        return self.app.state.lp

    def new_tenant(self, name: str, **quota) -> tuple[int, str]:
        with self.sessions() as session:
            tenant = crud.create_tenant(session, name=name)
            if quota:
                crud.set_quota(session, tenant_id=tenant.id, **quota)
            secret, _ = crud.create_key(session, tenant_id=tenant.id)
            return tenant.id, secret


@contextmanager
def run_server(model_dir: Path, data_dir: Path, **settings_overrides):
    port = free_port()
    defaults = dict(
        data_dir=data_dir,
        model=str(model_dir),
        host="127.0.0.1",
        port=port,
        admin_key=ADMIN_KEY,
        dtype="float32",
        max_model_len=256,
        # The server shares this process with the tests: keep their thread count.
        engine_threads=torch.get_num_threads(),
    )
    settings = Settings(**{**defaults, **settings_overrides})
    with serve_in_thread(settings) as (app, url):
        db = make_engine(settings.database_url)
        try:
            yield RunningServer(url, settings, app, make_sessionmaker(db))
        finally:
            db.dispose()


def upload_adapter(url: str, key: str, name: str, folder: Path) -> httpx.Response:
    """POST /v1/adapters with a PEFT folder's two files, as a tenant's client would."""
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())
             if p.name in ("adapter_config.json", "adapter_model.safetensors")]  # fmt: skip
    return httpx.post(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {key}"},
                      data={"name": name}, files=files, timeout=60)  # fmt: skip
