"""n and best_of through the official `openai` client: several choices from one prompt,
streamed per choice, each sample billed once (best_of's unreturned samples too)."""

from __future__ import annotations

import openai
import pytest

from tests.utils.server import run_server

MAX = 6
EXTRA = {"ignore_eos": True}  # every sample runs to max_tokens: exact token counts


@pytest.fixture(scope="module")
def client(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("n")) as srv:
        _, key = srv.new_tenant("n")
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
        client.base_model = srv.state.model_name
        yield client


def complete(client, **kw):
    return client.completions.create(
        model=client.base_model,
        prompt="one two three",
        max_tokens=MAX,
        seed=11,
        extra_body=EXTRA,
        **kw,
    )


def test_n_choices_each_billed_and_the_first_is_the_seeded_single(client):
    many = complete(client, n=3, temperature=1.0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in many.choices)
    assert many.usage.completion_tokens == 3 * MAX
    assert len({c.text for c in many.choices}) > 1  # own seed streams
    single = complete(client, n=1, temperature=1.0)
    assert single.choices[0].text == many.choices[0].text
    assert many.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once


def test_streamed_choices_add_up_to_the_whole_answer(client):
    whole = complete(client, n=3, temperature=1.0)
    texts: dict[int, str] = {}
    finishes: dict[int, list] = {}
    usage = None
    for chunk in complete(
        client, n=3, temperature=1.0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert usage.completion_tokens == 3 * MAX


def test_chat_n_choices(client):
    r = client.chat.completions.create(
        model=client.base_model,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=MAX,
        temperature=1.0,
        seed=3,
        extra_body=EXTRA,
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.message.content for c in r.choices)
    assert r.usage.completion_tokens == 2 * MAX


def test_best_of_returns_n_and_bills_every_sample(client):
    r = complete(client, n=1, best_of=3, temperature=1.0)
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.usage.completion_tokens == 3 * MAX


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 17}, "n"),
    ],
)
def test_refused_combinations(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, **kw)
    assert e.value.body["param"] == param or param in str(e.value.body)


def test_n_with_tools_is_refused(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=client.base_model, messages=[{"role": "user", "content": "hi"}], n=2, tools=[tool]
        )


@pytest.mark.parametrize("n", [1, 2])
def test_echo_puts_the_prompt_before_each_choice(client, n):
    plain = complete(client, n=n, temperature=1.0)
    echoed = complete(client, n=n, temperature=1.0, echo=True)
    assert [c.text for c in echoed.choices] == ["one two three" + c.text for c in plain.choices]
    streamed: dict[int, str] = {}
    for chunk in complete(client, n=n, temperature=1.0, echo=True, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in echoed.choices}
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens  # echo is free
    # With logprobs: each choice's cover the prompt (shared by the samples), then its own.
    scored = complete(client, n=n, temperature=1.0, echo=True, logprobs=1)
    assert [c.text for c in scored.choices] == [c.text for c in echoed.choices]
    p = scored.usage.prompt_tokens
    prompt_parts = {tuple(c.logprobs.token_logprobs[:p]) for c in scored.choices}
    assert len(prompt_parts) == 1 and next(iter(prompt_parts))[0] is None
    assert all(len(c.logprobs.tokens) == p + MAX for c in scored.choices)
    assert scored.usage.completion_tokens == n * MAX
