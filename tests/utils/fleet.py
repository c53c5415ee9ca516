"""Helpers for tests of several replicas: tenants through the admin API, completions that
name their adapter for Ray's router, and the usage a client saw in an answer."""

from __future__ import annotations

import json

import httpx

from tests.utils.server import ADMIN_KEY
from tests.utils.uploads import auth

MODEL_ID_HEADER = "serve_multiplexed_model_id"  # Ray Serve's multiplexing header


def new_tenant(url: str, name: str, quota: dict | None = None) -> tuple[int, int, str]:
    """(tenant id, key id, key secret) of a new tenant made through replica `url`."""
    admin = auth(ADMIN_KEY)
    tenant = httpx.post(f"{url}/admin/api/tenants", headers=admin, json={"name": name},
                        timeout=30)  # fmt: skip
    assert tenant.status_code == 201, tenant.text
    tid = tenant.json()["id"]
    if quota:
        put = httpx.put(f"{url}/admin/api/tenants/{tid}/quota", headers=admin, json=quota,
                        timeout=30)  # fmt: skip
        assert put.status_code == 200, put.text
    key = httpx.post(f"{url}/admin/api/tenants/{tid}/keys", headers=admin, timeout=30)
    assert key.status_code == 201, key.text
    return tid, key.json()["id"], key.json()["secret"]


def complete(
    url: str, key: str, model: str, *, max_tokens: int = 4, stream: bool = False,
    timeout: float = 60, user: str | None = None,
) -> httpx.Response:  # fmt: skip
    body = {"model": model, "prompt": "The quick brown", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}  # fmt: skip
    if user is not None:
        body["user"] = user
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {**auth(key), MODEL_ID_HEADER: model}
    return httpx.post(f"{url}/v1/completions", headers=headers, json=body, timeout=timeout)


def received_usage(response: httpx.Response) -> tuple[str, int, int]:
    """(request id, prompt tokens, completion tokens) as the client saw them: the usage of
    the answer, or of a stream's last chunk, checked against the tokens that arrived."""
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
        usage = events[-1]["usage"]
        chunks = [c for e in events for c in e["choices"]]
        assert "".join(c["text"] for c in chunks), "a stream with no text"
        return events[0]["id"], usage["prompt_tokens"], usage["completion_tokens"]
    body = response.json()
    return body["id"], body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
