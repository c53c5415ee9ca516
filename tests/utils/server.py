"""A real loraplex server on 127.0.0.1 for API tests (uvicorn in a background thread)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.platform.db import crud
from loraplex.platform.db.session import make_engine, make_sessionmaker
from loraplex.platform.settings import Settings
from testkit.server import ADMIN_KEY, free_port, serve_in_thread, upload_adapter

__all__ = ["ADMIN_KEY", "RunningServer", "free_port", "run_server", "serve_in_thread",
           "upload_adapter"]  # fmt: skip


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
