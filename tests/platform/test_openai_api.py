"""The official `openai` client, unchanged, against a running server."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from loraplex.platform.db.models import UsageRecord
from tests.utils.server import run_server, upload_adapter
from tests.utils.sse_client import stream_completion


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("srv")) as srv:
        yield srv


@pytest.fixture(scope="module")
def tenant(server):
    return server.new_tenant("acme")


@pytest.fixture(scope="module")
def client(server, tenant):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=tenant[1], max_retries=0)


def _upload(server, key, name, folder):
    return upload_adapter(server.url, key, name, folder)


def test_models_lists_base_and_own_adapters(server, tenant, client, tiny_adapters):
    assert _upload(server, tenant[1], "qv", tiny_adapters["llama"]["qv4"]).status_code == 201
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == server.state.model_name and "qv" in ids


def test_completion_with_and_without_adapter(server, client, tenant, tiny_adapters):
    if "qv" not in [m.id for m in client.models.list().data]:
        _upload(server, tenant[1], "qv", tiny_adapters["llama"]["qv4"])
    base = client.completions.create(
        model=server.state.model_name, prompt="The quick brown", max_tokens=8, temperature=0
    )
    lora = client.completions.create(
        model="qv", prompt="The quick brown", max_tokens=8, temperature=0
    )
    assert base.usage.completion_tokens == 8 and base.choices[0].finish_reason == "length"
    assert base.choices[0].text != lora.choices[0].text  # the adapter is applied
    again = client.completions.create(
        model="qv", prompt="The quick brown", max_tokens=8, temperature=0
    )
    assert again.choices[0].text == lora.choices[0].text


def test_chat_and_streaming_with_usage(server, client):
    msgs = [{"role": "user", "content": "Say something"}]
    full = client.chat.completions.create(
        model=server.state.model_name, messages=msgs, max_tokens=10, temperature=0
    )
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=server.state.model_name,
        messages=msgs,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason


def test_errors_map_to_openai_exceptions(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="lpx_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=server.state.model_name, prompt="x", max_tokens=2, temperature=5
        )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.state.model_name, prompt="x", max_tokens=10_000)
    assert "context length" in e.value.message


def test_rate_limit_answers_429_with_retry_after(server):
    _, key = server.new_tenant("tiny-quota", requests_per_min=2)
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    for _ in range(2):
        c.completions.create(model=server.state.model_name, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=server.state.model_name, prompt="hi", max_tokens=1)
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_usage_ledger_matches_what_clients_received(server):
    """24 concurrent streams (more than the database pool's 15 connections: a stream must not
    hold one), a third hung up mid-stream: each usage record bills exactly the tokens its
    client received, and every KV block comes back. The streams that hang up ask for far
    more tokens than they take (LEFT), so that they leave before the end however fast the
    engine runs next to their hang-up."""
    tenant_id, key = server.new_tenant("ledger")
    N, LEFT = 24, 200
    body = {
        "model": server.state.model_name,
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
    }

    async def main():
        return await asyncio.gather(
            *(
                stream_completion(
                    server.url,
                    key,
                    {
                        **body,
                        "prompt": f"request {i}",
                        **({"max_tokens": LEFT} if i % 3 == 0 else {}),
                    },
                    hang_up_after=2 + i // 2 if i % 3 == 0 else None,
                )
                for i in range(N)
            )
        )

    results = asyncio.run(main())
    state = server.state
    for _ in range(100):  # cancelled requests are recorded when the server notices
        if not state.inflight:
            break
        time.sleep(0.05)
    with server.sessions() as session:
        rows = {r.request_id: r for r in session.query(UsageRecord).filter_by(tenant_id=tenant_id)}
    assert len(rows) == N and all(r.request_id in rows for r in results)
    hung_up = [r for i, r in enumerate(results) if i % 3 == 0]
    assert all(not r.finished and r.tokens < LEFT for r in hung_up)  # they really left early
    assert {rows[r.request_id].status for r in hung_up} == {"aborted"}
    for r in results:
        assert rows[r.request_id].completion_tokens == r.tokens, r
    assert all(r.finished and r.tokens == 24 for i, r in enumerate(results) if i % 3)
    for _ in range(100):  # every KV block is free again (stats may be a step stale)
        stats = state.engine.stats()
        if stats.kv_usage == 0 and stats.running == 0:
            break
        time.sleep(0.05)
    assert stats.kv_usage == 0 and stats.running == stats.waiting == 0, stats
