"""One real server for the third-party clients: the tiny llama model, each client a tenant of
its own with adapter `tuned` (the `attn8` test adapter) as the request's `model`."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from loraplex.platform.db.models import UsageRecord
from testkit.venvs import client_venvs
from tests.utils.server import ADMIN_KEY, RunningServer, run_server, upload_adapter

ADAPTER = "tuned"
# Pinned, each as its users install it (torch comes from constraints.txt).
CLIENTS = {
    "guidellm": ["guidellm==0.8.1"],
    # transformers: the tokenizer its local-completions model counts context tokens with
    "lm-eval": ["lm-eval[api]==0.4.13", "transformers==5.25.0"],
}


@dataclass
class Tenant:
    server: RunningServer
    tenant_id: int
    key: str
    model_dir: Path  # the base model's folder: its tokenizer is the clients' tokenizer
    adapter_dir: Path

    @property
    def url(self) -> str:
        return self.server.url

    def usage(self) -> dict:
        """This tenant's totals for `tuned`, from the admin usage API (since yesterday: a run
        across midnight at a month's end stays in one period)."""
        since = (datetime.now(UTC) - timedelta(days=1)).date().isoformat()
        r = httpx.get(
            f"{self.url}/admin/api/usage",
            params={"group_by": "adapter", "tenant_id": self.tenant_id, "start": since},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        (row,) = [row for row in r.json()["data"] if row["adapter"] == ADAPTER]
        return row

    def ledger(self) -> dict[str, UsageRecord]:
        """This tenant's usage rows by request id (the `id` its clients were answered)."""
        with self.server.sessions() as session:
            rows = session.query(UsageRecord).filter_by(tenant_id=self.tenant_id).all()
            session.expunge_all()
        return {row.request_id: row for row in rows}


@pytest.fixture(scope="package")
def client_bins() -> dict[str, Future[Path]]:
    """Each client's venv `bin/`, made in the background (ask for the server after this)."""
    return client_venvs(CLIENTS)


@pytest.fixture(scope="package")
def clients_server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("clients-server")) as srv:
        yield srv


@pytest.fixture(scope="package")
def new_tenant(clients_server, tiny_models, tiny_adapters) -> Callable[[str], Tenant]:
    def make(name: str) -> Tenant:
        tenant_id, key = clients_server.new_tenant(name)
        adapter = tiny_adapters["llama"]["attn8"]
        r = upload_adapter(clients_server.url, key, ADAPTER, adapter)
        assert r.status_code == 201, r.text
        return Tenant(clients_server, tenant_id, key, tiny_models["llama"], adapter)

    return make
