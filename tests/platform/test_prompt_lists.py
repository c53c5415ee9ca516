"""/v1/completions with a list of prompts, through the official `openai` client, as batched
evaluation harnesses send it (lm-eval's local-completions with batch_size > 1): every prompt's
choices equal the same prompt sent alone, indexed prompt * n + j, started in the engine
together, one usage record per prompt with exactly the tokens its choices were sent."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from loraplex.platform.db.models import UsageRecord
from tests.utils.server import run_server
from tests.utils.sse_client import stream_completion

PROMPTS = ["The capital of France is", "one two three", "Hello, my name is"]
MAX = 5
EXTRA = {"ignore_eos": True}  # every choice runs to max_tokens: exact token counts


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("lists")) as srv:
        yield srv


@pytest.fixture(scope="module")
def tenant(server):
    return server.new_tenant("lists")


@pytest.fixture(scope="module")
def client(server, tenant):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=tenant[1], max_retries=0)


def complete(client, server, prompt, **kw):
    kw = {"max_tokens": MAX, "temperature": 0.0, "extra_body": EXTRA, **kw}
    return client.completions.create(model=server.state.model_name, prompt=prompt, **kw)


def records(server, tenant_id: int) -> dict[str, UsageRecord]:
    for _ in range(100):  # a request is in flight until its record is written
        if not server.state.inflight:
            break
        time.sleep(0.05)
    with server.sessions() as session:
        rows = session.query(UsageRecord).filter_by(tenant_id=tenant_id).all()
        return {r.request_id: r for r in rows}


def _same_choice(got, alone, index: int) -> None:
    assert got.index == index
    assert got.text == alone.text and got.finish_reason == alone.finish_reason
    if alone.logprobs is not None:
        assert got.logprobs.tokens == alone.logprobs.tokens
        assert got.logprobs.text_offset == alone.logprobs.text_offset
        assert got.logprobs.token_logprobs == pytest.approx(alone.logprobs.token_logprobs, abs=1e-5)


def test_each_choice_is_its_prompt_sent_alone(server, client, tenant):
    before = records(server, tenant[0])
    both = complete(client, server, PROMPTS, n=2, logprobs=2)
    assert [c.index for c in both.choices] == list(range(2 * len(PROMPTS)))
    alone = [complete(client, server, p, n=2, logprobs=2) for p in PROMPTS]
    for p, single in enumerate(alone):
        for j in range(2):
            _same_choice(both.choices[p * 2 + j], single.choices[j], p * 2 + j)
    u = both.usage
    assert u.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert u.completion_tokens == 2 * MAX * len(PROMPTS)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # One record per prompt, named after the answer, each with its own tokens.
    new = {k: v for k, v in records(server, tenant[0]).items() if k not in before}
    mine = sorted((k for k in new if k.startswith(both.id)), key=lambda k: int(k.rsplit("-")[-1]))
    assert mine == [f"{both.id}-{p}" for p in range(len(PROMPTS))]
    for p, key in enumerate(mine):
        assert new[key].prompt_tokens == alone[p].usage.prompt_tokens
        assert new[key].completion_tokens == 2 * MAX and new[key].status == "ok"


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_token_id_prompts_scored_with_echo_as_lm_eval_asks(server, client, max_tokens):
    # lm-eval's loglikelihood requests: token ids, echo, logprobs 1, max_tokens 1 (it drops
    # the generated token) or 0, seed.
    tok = server.state.engine.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    kw = {"echo": True, "logprobs": 1, "max_tokens": max_tokens, "seed": 1234, "extra_body": {}}
    scored = complete(client, server, ids, **kw)
    assert [c.index for c in scored.choices] == [0, 1, 2]
    assert scored.usage.completion_tokens == max_tokens * len(ids)
    assert scored.usage.prompt_tokens == sum(len(i) for i in ids)
    for p, prompt_ids in enumerate(ids):
        _same_choice(scored.choices[p], complete(client, server, prompt_ids, **kw).choices[0], p)
        assert len(scored.choices[p].logprobs.tokens) == len(prompt_ids) + max_tokens


def test_generation_as_lm_eval_asks(server, client):
    # generate_until with batch_size > 1: a list, greedy, a seed and its `until` strings
    # plus the end-of-text string: more stop sequences than OpenAI's 4.
    stops = ["\n\n", "Question:", "</s>", "<|im_end|>", "\nclass", "\ndef"]
    kw = {"max_tokens": 12, "seed": 1234, "stop": stops, "extra_body": {}}
    many = complete(client, server, PROMPTS, **kw)
    for p, prompt in enumerate(PROMPTS):
        _same_choice(many.choices[p], complete(client, server, prompt, **kw).choices[0], p)


def test_prompts_run_in_the_engine_together(server, client):
    steps = server.state.engine.stats().steps
    many = complete(client, server, [f"prompt number {i}" for i in range(8)], max_tokens=8)
    assert many.usage.completion_tokens == 64
    # One after another they would take 8 x 8 model steps; started together, about 8.
    assert server.state.engine.stats().steps - steps <= 16


def test_streamed_chunks_carry_their_choice_index_and_continuous_usage(server, client, tenant):
    whole = complete(client, server, PROMPTS, n=2)
    texts: dict[int, str] = {}
    chunks = list(complete(client, server, PROMPTS, n=2, stream=True,
                           stream_options={"include_usage": True,
                                           "continuous_usage_stats": True}))  # fmt: skip
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in whole.choices}
    # vLLM's continuous usage: every chunk says the usage so far; the last is the sum.
    assert all(c.usage is not None for c in chunks)
    counts = [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)
              for c in chunks]  # fmt: skip
    final = (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    assert counts == sorted(counts) and counts[-2] == counts[-1] == final
    assert not chunks[-1].choices and all(c.choices for c in chunks[:-1])


def test_a_stream_left_early_bills_each_prompt_what_it_was_sent(server, tenant):
    # Long enough that the server notices the hang-up well before the end.
    body = {"model": server.state.model_name, "prompt": PROMPTS, "max_tokens": 64,
            "logprobs": 0, "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    got = asyncio.run(stream_completion(server.url, tenant[1], body, hang_up_after=10))
    assert not got.finished and 10 <= got.tokens < 3 * 64
    rows = [r for k, r in records(server, tenant[0]).items() if k.startswith(got.request_id)]
    assert len(rows) == 3 and {r.status for r in rows} == {"aborted"}
    assert sum(r.completion_tokens for r in rows) == got.tokens


def test_a_refused_prompt_is_named_and_nothing_is_billed(server):
    tenant_id, key = server.new_tenant("lists-quota", tokens_per_min=64)
    headers = {"Authorization": f"Bearer {key}"}
    too_long = "word " * 300  # past the 256-token context
    body = {"model": server.state.model_name, "prompt": ["hi", too_long], "max_tokens": 40}
    r = httpx.post(f"{server.url}/v1/completions", headers=headers, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["message"].startswith("prompt 1:")
    assert not records(server, tenant_id)
    # The first prompt's reservation was given back: a request needing nearly the whole
    # minute's budget still passes.
    body = {"model": server.state.model_name, "prompt": "hi", "max_tokens": 40}
    r = httpx.post(f"{server.url}/v1/completions", headers=headers, json=body, timeout=60)
    assert r.status_code == 200, r.text
    for bad, message in (([], "must not be empty"), (["a", ""], "prompt 1 is empty"),
                         ([[1, 2], []], "prompt 1 is empty")):  # fmt: skip
        r = httpx.post(f"{server.url}/v1/completions", headers=headers,
                       json={**body, "prompt": bad, "max_tokens": 2})  # fmt: skip
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "prompt"
