"""`loraplex agent` beside vLLM: the platform asks it over HTTP to put a version in place; it
fetches the object from the store into its own folder (no filesystem shared with the
platform), checks the digest, loads it into vLLM under the version's opaque name; a stored
object whose bytes changed is refused, as is a DoRA one stored before, and the agent keeps at
most `max_adapters` loaded; a name vLLM has from an earlier agent is re-pointed in place."""

from __future__ import annotations

import shutil
import threading

import httpx
import pytest
import uvicorn

from loraplex.platform.dataplane.agent import Agent
from loraplex.platform.dataplane.agent_app import create_agent_app
from loraplex.platform.store.base import adapter_digest
from loraplex.platform.store.local import LocalStore
from testkit.server import wait_ready
from tests.platform.dataplane.test_end_to_end import PROMPT
from tests.utils.server import free_port, run_server, upload_adapter
from tests.utils.uploads import complete


@pytest.fixture
def agent(vllm_url, tmp_path):
    store = LocalStore(tmp_path / "store")
    agent = Agent(vllm_url, store, tmp_path / "agent-cache", max_adapters=2)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_agent_app(agent), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/healthz", 30, "the agent")
    yield agent, url, tmp_path / "store"
    server.should_exit = True
    thread.join(10)
    agent.close()


def test_the_platform_loads_through_the_agent(agent, vllm_url, plane_model, plane_adapters,
                                              tmp_path):  # fmt: skip
    agent_, agent_url, store_dir = agent
    with run_server(plane_model, tmp_path / "data", data_plane="vllm", vllm_urls=vllm_url,
                    vllm_agent_urls=agent_url, store_url=store_dir.as_uri()) as srv:  # fmt: skip
        _, key = srv.new_tenant("agented")
        for name in ("a", "b"):
            assert upload_adapter(srv.url, key, name, plane_adapters[name]).status_code == 201
        for name in ("a", "b"):
            r = complete(srv.url, key, name, PROMPT)
            assert r.status_code == 200, r.text
        models = httpx.get(f"{vllm_url}/v1/models").json()["data"]
        roots = {m["id"]: m["root"] for m in models if m["parent"] is not None}
        loaded = agent_.loaded()
        assert len(loaded) == 2 and all(roots[n].startswith(str(agent_.cache.dir)) for n in loaded)
        # DoRA: refused at upload, by name (vLLM has no DoRA).
        dora = upload_adapter(srv.url, key, "dora", plane_adapters["dora"])
        assert dora.status_code == 422 and "vLLM data plane" in dora.json()["error"]["message"]

        # A third adapter: the least recently used one is unloaded from vLLM.
        first = loaded[0]
        assert upload_adapter(srv.url, key, "c", plane_adapters["a"]).status_code == 201
        assert complete(srv.url, key, "c", PROMPT).status_code == 200
        models = httpx.get(f"{vllm_url}/v1/models").json()["data"]
        assert first not in {m["id"] for m in models} and len(agent_.loaded()) == 2


def test_a_changed_stored_object_is_refused(agent, plane_adapters):
    agent_, agent_url, store_dir = agent
    store = LocalStore(store_dir)
    digest = adapter_digest(plane_adapters["a"])
    key = store.put(plane_adapters["a"], digest)
    # The object's bytes are swapped for another adapter's after it was registered.
    stored = next(p for p in store_dir.rglob("adapter_model.safetensors") if key in str(p))
    shutil.copy(plane_adapters["b"] / "adapter_model.safetensors", stored)
    r = httpx.post(f"{agent_url}/v1/ensure", json={"name": "lpx-x", "key": key,
                                                   "digest": digest}, timeout=60)  # fmt: skip
    assert r.status_code == 503 and "hash" in r.json()["detail"], r.text
    assert agent_.loaded() == []


def test_a_stored_dora_object_is_refused_before_vllm_sees_it(agent, plane_adapters):
    """Stored while the server ran the embedded engine, asked for after the switch to vLLM."""
    agent_, agent_url, store_dir = agent
    digest = adapter_digest(plane_adapters["dora"])
    key = LocalStore(store_dir).put(plane_adapters["dora"], digest)
    r = httpx.post(f"{agent_url}/v1/ensure", json={"name": "lpx-dora", "key": key,
                                                   "digest": digest}, timeout=60)  # fmt: skip
    assert r.status_code == 422 and "vLLM data plane" in r.json()["detail"], r.text
    assert agent_.loaded() == []


def test_a_name_from_an_earlier_agent_is_loaded_in_place(agent, vllm_url, plane_adapters,
                                                         tmp_path):  # fmt: skip
    agent_, _, store_dir = agent
    digest = adapter_digest(plane_adapters["a"])
    key = LocalStore(store_dir).put(plane_adapters["a"], digest)
    # An earlier agent registered the name from its cache, since wiped with its pod's disk.
    old = shutil.copytree(plane_adapters["a"], tmp_path / "old-agent-cache")
    r = httpx.post(f"{vllm_url}/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "lpx-inplace", "lora_path": str(old)})  # fmt: skip
    assert r.status_code == 200, r.text
    shutil.rmtree(old)
    agent_.ensure("lpx-inplace", key, digest)
    models = httpx.get(f"{vllm_url}/v1/models").json()["data"]
    root = next(m["root"] for m in models if m["id"] == "lpx-inplace")
    assert root.startswith(str(agent_.cache.dir)), root  # vLLM now reads this agent's copy
    assert agent_.loaded() == ["lpx-inplace"]
    agent_.unload("lpx-inplace")
