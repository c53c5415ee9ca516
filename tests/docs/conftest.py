"""One live server (tiny Llama, SQLite, a local store) for every block of every page, and the
count of blocks run and skipped, with the reasons, at the end of the session."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from loraplex.platform.db import crud
from tests.utils.server import ADMIN_KEY, RunningServer, run_server
from tests.utils.uploads import auth, folder_parts

# Filled by the block tests: (block id, reason or None when it ran).
OUTCOMES: list[tuple[str, str | None]] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not OUTCOMES:
        return
    skipped = [(where, why) for where, why in OUTCOMES if why is not None]
    terminalreporter.section("docs blocks")
    terminalreporter.write_line(
        f"docs blocks: {len(OUTCOMES) - len(skipped)} run, {len(skipped)} skipped"
    )
    for where, why in skipped:
        terminalreporter.write_line(f"  skipped {where}: {why}")


@dataclass
class DocsServer:
    """The server, and what a block's run is given: a fresh tenant, a folder per page."""

    server: RunningServer
    root: Path
    adapters: dict[str, Path]  # tiny Llama adapters, by ADAPTER_SPECS name
    tenants: int = 0
    demo_adapter: Path | None = None
    request: pytest.FixtureRequest | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.server.url

    def tenant(self, name: str | None) -> tuple[int, str, str]:
        """(id, key, name) of a new tenant; a name already taken passes to the newcomer (its
        holder is renamed), so each block that names a tenant finds it in the state it set."""
        self.tenants += 1
        name = name or f"docs-{self.tenants}"
        with self.server.sessions() as session:
            held = crud.get_tenant_by_name(session, name=name)
            if held is not None:
                held.name = f"{name}-was-{self.tenants}"
                session.commit()
        tenant_id, key = self.server.new_tenant(name)
        return tenant_id, key, name

    def page_dir(self, page: Path) -> Path:
        """The page's working folder: PEFT folders `v1/`, `v2/`, `ckpt/` for its uploads."""
        folder = self.root / "pages" / page.stem
        if not folder.exists():
            for name, source in (("v1", "qv4"), ("v2", "attn8"), ("ckpt", "qv4")):
                shutil.copytree(self.adapters[source], folder / name)
        return folder

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        s = self.server.settings
        env.update(
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            LORAPLEX_DATA_DIR=str(s.data_dir),
            LORAPLEX_DATABASE_URL=s.database_url,
            LORAPLEX_ADMIN_KEY=ADMIN_KEY,
            ADMIN_KEY=ADMIN_KEY,
            URL=self.url,
            LORAPLEX_URL=self.url,  # the batches commands' server, for their default address
            HF_HUB_OFFLINE="1",
        )
        return env

    def upload(self, key: str, name: str, adapter: str) -> None:
        r = httpx.post(f"{self.url}/v1/adapters", headers=auth(key), data={"name": name},
                       files=folder_parts(self.adapters[adapter]), timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text

    def alias(self, key: str, name: str, alias: str, body: dict) -> None:
        r = httpx.put(f"{self.url}/v1/adapters/{name}/aliases/{alias}", headers=auth(key),
                      json=body, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text


@pytest.fixture(scope="session")
def docs_server(tiny_models, tiny_adapters, tmp_path_factory, request) -> Iterator[DocsServer]:
    root = tmp_path_factory.mktemp("docs")
    data = root / "data"
    # docs/fleet.md's load_lora_adapter reads `team-a/sql-v3` inside the import root.
    shutil.copytree(tiny_adapters["llama"]["attn8"], data / "adapter-imports" / "team-a" / "sql-v3")
    with run_server(tiny_models["llama"], data, max_model_len=512) as server:
        yield DocsServer(server, root, tiny_adapters["llama"], request=request)
