"""Request bodies are strict, as OpenAI's API is: a wrong JSON type or an unknown field is a
400 `invalid_request_error` naming the field; nothing is coerced. The fields OpenAI clients
may send that change nothing here are accepted and documented as ignored."""

from __future__ import annotations

import httpx
import openai
import pytest

from loraplex.platform.openai.protocol import IGNORED_FIELDS, IGNORED_MESSAGE_FIELDS
from tests.utils.server import ADMIN_KEY, run_server


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("strict")) as srv:
        yield srv


@pytest.fixture(scope="module")
def key(server):
    return server.new_tenant("strict")[1]


def _post(server, key, path, body):
    return httpx.post(f"{server.url}{path}", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip


def _completion(server, **fields):
    return {"model": server.state.model_name, "prompt": "Hello", "max_tokens": 2, **fields}


def _chat(server, **fields):
    messages = [{"role": "user", "content": "Hello"}]
    return {"model": server.state.model_name, "messages": messages, "max_tokens": 2, **fields}


def _assert_refused(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field and field in error["message"], error


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", "2"), ("max_tokens", 2.5), ("temperature", "0.5"), ("stream", "true"),
     ("stream", 1), ("seed", "7"), ("seed", -1), ("top_p", "1"),
     ("stop", 5), ("logprobs", "1"), ("ignore_eos", 0), ("top_k", "3"), ("user", 7)],
)  # fmt: skip
def test_completion_wrong_types_are_refused(server, key, field, value):
    _assert_refused(_post(server, key, "/v1/completions", _completion(server, **{field: value})),
                    field)  # fmt: skip


@pytest.mark.parametrize(
    "field, value",
    [("max_completion_tokens", "4"), ("logprobs", "true"), ("top_logprobs", "2"),
     ("presence_penalty", "0"), ("n", "1")],
)  # fmt: skip
def test_chat_wrong_types_are_refused(server, key, field, value):
    _assert_refused(_post(server, key, "/v1/chat/completions", _chat(server, **{field: value})),
                    field)  # fmt: skip


def test_wrong_types_inside_nested_objects_name_the_path(server, key):
    body = _chat(server, messages=[{"role": "user", "content": 5}])
    r = _post(server, key, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content")
    body = _completion(server, stream=True, stream_options={"include_usage": "yes"})
    r = _post(server, key, "/v1/completions", body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options.include_usage"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_refused(server, key, path):
    body = (_completion if "chat" not in path else _chat)(server, max_tokenz=3)
    _assert_refused(_post(server, key, path, body), "max_tokenz")


def test_documented_ignored_fields_are_accepted(server, key):
    ignored = {"metadata": {"team": "a"}, "store": False, "service_tier": "auto",
               "prompt_cache_key": "k1", "safety_identifier": "user-1",
               "skip_special_tokens": True, "spaces_between_special_tokens": True}  # fmt: skip
    assert set(ignored) == set(IGNORED_FIELDS)
    for path, make in (("/v1/completions", _completion), ("/v1/chat/completions", _chat)):
        r = _post(server, key, path, make(server, **ignored))
        assert r.status_code == 200, r.text
    # An assistant message sent back as the openai client returned it, with its extra fields.
    echoed = {"role": "assistant", "content": "Hi", **dict.fromkeys(IGNORED_MESSAGE_FIELDS)}
    body = _chat(server, messages=[{"role": "user", "content": "Hello"}, echoed,
                                   {"role": "user", "content": "Again"}])  # fmt: skip
    assert _post(server, key, "/v1/chat/completions", body).status_code == 200


def test_openai_client_maps_a_strict_refusal_to_bad_request(server, key):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=server.state.model_name, prompt="Hi",
                                  extra_body={"max_tokens": "2"})  # fmt: skip
    # Integers for floats are JSON numbers like any other: accepted.
    out = client.completions.create(model=server.state.model_name, prompt="Hi", max_tokens=2,
                                    temperature=1, top_p=1)  # fmt: skip
    assert out.choices


def test_admin_bodies_are_strict(server):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(f"{server.url}/admin/api/tenants", json={"name": "t-str", "weight": "2"},
                   headers=admin)  # fmt: skip
    _assert_refused(r, "weight")
    r = httpx.post(f"{server.url}/admin/api/tenants", json={"name": "t-ok", "weight": 2,
                   "price_prompt_per_1k": "0.25"}, headers=admin)  # fmt: skip
    assert r.status_code == 201, r.text
    tenant = r.json()["id"]
    r = httpx.put(f"{server.url}/admin/api/tenants/{tenant}/quota",
                  json={"requests_per_min": "10"}, headers=admin)  # fmt: skip
    _assert_refused(r, "requests_per_min")
    r = httpx.patch(f"{server.url}/admin/api/tenants/{tenant}", json={"status": "suspended"},
                    headers=admin)  # fmt: skip
    assert r.status_code == 200 and r.json()["status"] == "suspended"
    expiry = {"name": "k", "expires_at": "2030-01-01T00:00:00Z"}
    r = httpx.post(f"{server.url}/admin/api/tenants/{tenant}/keys", json=expiry, headers=admin)
    assert r.status_code == 201, r.text
