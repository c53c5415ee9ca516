"""vLLM's operational routes, as clients written against vLLM probe them (guidellm checks
`GET /health` before it sends anything; SageMaker and some routers use `/ping`)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.utils.server import run_server, upload_adapter

# vLLM's ModelCard fields, as its /v1/models writes them, and our `architecture`.
CARD = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission",
        "architecture"}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("vllm")) as srv:
        yield srv


def test_health_and_ping_answer_as_vllm_while_serving(server):
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.content == b""
    for method in ("GET", "POST"):
        ping = httpx.request(method, f"{server.url}/ping")
        assert ping.status_code == 200 and ping.content == b""


def test_version_is_the_package_version(server):
    from importlib.metadata import version

    assert httpx.get(f"{server.url}/version").json() == {"version": version("loraplex")}


def test_models_are_vllm_model_cards(server, tiny_adapters):
    _, key = server.new_tenant("cards")
    assert upload_adapter(server.url, key, "qv", tiny_adapters["llama"]["qv4"]).status_code == 201
    data = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    assert data["object"] == "list"
    base, adapter = data["data"]
    for card in (base, adapter):
        assert set(card) == CARD and card["object"] == "model"
        assert card["max_model_len"] == server.settings.max_model_len
        (perm,) = card["permission"]
        assert perm["object"] == "model_permission" and perm["allow_sampling"] is True
        assert perm["allow_logprobs"] is True and perm["id"].startswith("modelperm-")
    assert base["parent"] is None and adapter["parent"] == base["id"] == server.state.model_name
    dense = {"family": "llama", "mixture_of_experts": None}
    assert base["architecture"] == adapter["architecture"] == dense
    # The openai client reads the same list.
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    assert [m.id for m in client.models.list().data] == [base["id"], "qv"]


def test_health_is_503_once_the_engine_dies(tiny_models, tmp_path):
    with run_server(tiny_models["llama"], tmp_path) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        os.kill(srv.state.engine._proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while httpx.get(f"{srv.url}/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 five seconds after the kill"
            time.sleep(0.05)
        assert httpx.post(f"{srv.url}/ping").status_code == 503
