"""A `loraplex serve` subprocess for benchmarks: its own data dir, a tenant key, adapters.

    with LoraplexServer(model_dir, data_dir, max_loras=8) as srv:
        srv.upload_all(adapter_dirs)           # names a0000, a0001, … (kept across runs)
        ... HTTPTarget(srv.url, srv.api_key, srv.adapter_names(n), srv.model_name) ...

The server runs in its own process so the load generator never shares a GIL with it. The
tenant and key are made on the database before the server starts (the CLI's own path), and
adapters go through the public upload API, as a tenant would send them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ADMIN_KEY = "bench-admin-key-" + "b" * 24
TENANT = "bench"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ok(
    proc: subprocess.Popen, url: str, what: str, log_path: Path, timeout_s: float, every: float
) -> httpx.Response:
    """Poll `url` until it answers 200 (returned); fail if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {log_path}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(every)
    raise RuntimeError(f"{what} not ready after {timeout_s} s; see {log_path}")


def stop_process(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """Terminate our own child by its handle; kill it if it does not exit in time."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def adapter_name(i: int) -> str:
    return f"a{i:04d}"


def make_tenant_key(data_dir: Path, model: str) -> str:
    """A fresh key of tenant `bench` (created if missing) in the registry under `data_dir`."""
    from loraplex.platform.db import crud
    from loraplex.platform.db.session import make_engine, make_sessionmaker, upgrade
    from loraplex.platform.settings import Settings

    settings = Settings(data_dir=data_dir, model=model)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    db = make_engine(settings.database_url)
    try:
        with make_sessionmaker(db)() as session:
            tenant = crud.get_tenant_by_name(session, name=TENANT)
            if tenant is None:
                tenant = crud.create_tenant(session, name=TENANT)
            secret, _ = crud.create_key(session, tenant_id=tenant.id, name="bench")
            return secret
    finally:
        db.dispose()


class LoraplexServer:
    def __init__(
        self,
        model_dir: Path,
        data_dir: Path,
        *,
        port: int | None = None,
        log: Path | None = None,
        threads: int | None = None,  # OMP_NUM_THREADS of the server (None: inherit)
        **settings,  # LORAPLEX_* settings: dtype, max_loras, max_num_seqs, max_model_len, …
    ):
        self.model_dir, self.data_dir = Path(model_dir), Path(data_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = settings
        self.threads = threads
        self.log_path = log or self.data_dir / "server.log"
        self.proc: subprocess.Popen | None = None
        self.log_start = 0
        self.api_key = ""
        self.model_name = ""

    def __enter__(self) -> LoraplexServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 600) -> None:
        self.api_key = make_tenant_key(self.data_dir, str(self.model_dir))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        env.update(
            LORAPLEX_DATA_DIR=str(self.data_dir),
            LORAPLEX_MODEL=str(self.model_dir),
            LORAPLEX_PORT=str(self.port),
            LORAPLEX_ADMIN_KEY=ADMIN_KEY,
        )
        env.update({f"LORAPLEX_{k.upper()}": str(v) for k, v in self.settings.items()})
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("a")
        self.log_start = log.tell()  # where this start's lines begin: runs append to the log
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "loraplex.platform.cli", "serve"],  # -P: see hf_server
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()  # the child holds its own descriptor
        try:
            r = wait_until_ok(
                self.proc, f"{self.url}/readyz", "loraplex serve", self.log_path, timeout_s, 0.25
            )
        except RuntimeError:
            self.stop()
            raise
        self.model_name = r.json()["model"]

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc)
        self.proc = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def registered(self) -> set[str]:
        r = httpx.get(f"{self.url}/v1/adapters", headers=self._headers(), timeout=60)
        r.raise_for_status()
        body = r.json()
        items = body["data"] if isinstance(body, dict) else body
        return {a["name"] for a in items}

    def upload(self, name: str, folder: Path, client: httpx.Client | None = None) -> None:
        files = [
            ("files", (n, (folder / n).read_bytes()))
            for n in ("adapter_config.json", "adapter_model.safetensors")
        ]
        post = (client or httpx).post
        r = post(
            f"{self.url}/v1/adapters",
            headers=self._headers(),
            data={"name": name},
            files=files,
            timeout=120,
        )
        if r.status_code not in (201, 409):  # 409: there from an earlier run
            raise RuntimeError(f"upload of {name}: HTTP {r.status_code} {r.text[:300]}")

    def upload_all(self, folders: list[Path], progress: bool = True) -> list[str]:
        """Upload adapters as a0000, a0001, …, skipping those already registered."""
        have = self.registered()
        names = [adapter_name(i) for i in range(len(folders))]
        todo = [(n, f) for n, f in zip(names, folders, strict=True) if n not in have]
        if todo:
            from tqdm import tqdm

            with httpx.Client() as client:
                for name, folder in tqdm(todo, desc="uploading adapters", disable=not progress):
                    self.upload(name, folder, client)
        return names
