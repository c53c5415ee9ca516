"""Streams through the server while the engine preempts by swap (engine/memory/swap.py): every
stream must carry exactly the tokens the same request gets when it runs alone, none repeated
when a preempted request resumes and none dropped."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.utils.server import run_server, upload_adapter

MAX_TOKENS = 56


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    # 10 blocks of 16 tokens: one request (<= 101 tokens, 7 blocks) fits alone, six at once
    # must take turns. The engine runs in its own process, as in production.
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("srv"), max_model_len=128,
                    num_kv_blocks=10, swap_space_gib=0.01, preemption_mode="swap",
                    max_num_seqs=8) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def tenant(server, tiny_adapters):
    tenant = server.new_tenant("swapper")
    for name in ("qv4", "attn8"):
        r = upload_adapter(server.url, tenant[1], name, tiny_adapters["llama"][name])
        assert r.status_code == 201, r.text
    return tenant


def _requests(model_name: str) -> list[dict]:
    models = [model_name, "qv4", "attn8"]
    return [
        dict(
            model=models[i % 3],
            prompt=[(7 * i + 11 * j) % 400 + 50 for j in range(30 + 3 * i)],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        for i in range(6)
    ]


async def _stream(client: openai.AsyncOpenAI, req: dict) -> tuple[list[str], str, int]:
    """The tokens and text one stream delivered, in order, and the usage it reported."""
    tokens, text, usage = [], "", None
    stream = await client.completions.create(
        **req, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.logprobs.tokens if choice.logprobs else []
    return tokens, text, usage


def test_streams_resumed_after_swap_neither_repeat_nor_drop_a_token(server, tenant):
    requests = _requests(server.state.model_name)
    key = tenant[1]
    sync = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    alone = []
    for req in requests:  # one at a time: nothing is preempted
        c = sync.completions.create(**req).choices[0]
        assert len(c.logprobs.tokens) == MAX_TOKENS
        alone.append((c.logprobs.tokens, c.text))
    assert server.state.engine.stats().preemptions == 0

    async def together():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        async with client:
            return await asyncio.gather(*(_stream(client, r) for r in requests))

    streamed = asyncio.run(together())

    # The engine process sends its counters every 0.25 s: wait for a snapshot from after the
    # last step (two reads 0.5 s apart agree).
    stats, deadline = server.state.engine.stats(), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        stats, before = server.state.engine.stats(), stats
        if stats == before:
            break
    assert stats.preemptions > 0, "six requests in 10 blocks must preempt"
    assert stats.swapped_in > 0 and stats.swapped_in == stats.swapped_out
    scrape = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f'loraplex_kv_swaps{{direction="in"}} {float(stats.swapped_in)}' in scrape
    for i, ((tokens, text, usage), (want_tokens, want_text)) in enumerate(
        zip(streamed, alone, strict=True)
    ):
        assert usage == MAX_TOKENS, f"request {i}"
        assert tokens == want_tokens, f"request {i}: streamed tokens differ from its run alone"
        assert text == want_text, f"request {i}"
