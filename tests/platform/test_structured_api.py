"""Structured output, logit_bias, min_tokens and friends through the official `openai` client.

The tiny models are random: whatever they would say, the grammar must still turn it into JSON
that validates, on every row of a batch that mixes adapters, streamed or not.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.utils.server import run_server, upload_adapter

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]}, "maxItems": 2},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "tags", "capital"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
}
BAD_SCHEMA = {"name": "x", "schema": {"type": "nope"}}
ADAPTERS = ("qv4", "attn8", "mlp16")


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("structured")) as srv:
        yield srv


@pytest.fixture(scope="module")
def key(server, tiny_adapters):
    _, secret = server.new_tenant("structured")
    for name in ADAPTERS:
        r = upload_adapter(server.url, secret, name, tiny_adapters["llama"][name])
        assert r.status_code == 201, r.text
    return secret


@pytest.fixture(scope="module")
def client(server, key):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def aclient(server, key):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


async def _chat(aclient, model: str, i: int, stream: bool) -> tuple[str, str]:
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": f"Describe city number {i} as JSON."}],
        response_format=RESPONSE_FORMAT,
        max_completion_tokens=100,
        temperature=1.0,
        seed=i,
    )
    if not stream:
        r = await aclient.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    parts, reason = [], None
    async for chunk in await aclient.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(parts), reason


async def _completion(aclient, model: str, i: int, stream: bool) -> tuple[str, str]:
    kw = dict(
        model=model,
        prompt=f"City {i}:",
        max_tokens=100,
        temperature=1.0,
        seed=i,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    if not stream:
        r = await aclient.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    parts, reason = [], None
    async for chunk in await aclient.completions.create(**kw, stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
    return "".join(parts), reason


def test_json_schema_validates_for_every_request_mixed_adapters_streamed_or_not(
    server, key, aclient
):
    models = [server.state.model_name, *ADAPTERS]

    async def main():
        calls = [
            call(aclient, models[i % len(models)], i, stream)
            for i in range(6)
            for call in (_chat, _completion)
            for stream in (False, True)
        ]
        return await asyncio.gather(*calls)

    results = asyncio.run(main())  # 24 requests in flight together
    assert len(results) == 24
    for text, reason in results:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in results}) > 4


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"guided_regex": r"[A-Z][a-z]{2,5}-\d{2}"}, r"[A-Z][a-z]{2,5}-\d{2}"),
        ({"guided_choice": ["left", "right"]}, r"left|right"),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}, r"x\d\d?"),
        ({"structured_outputs": {"choice": ["up", "down"]}}, r"up|down"),
        ({"structured_outputs": {"regex": r"\d{3}"}}, r"\d{3}"),
        ({"response_format": {"type": "json_object"}, "max_tokens": 4}, None),
    ],
)
def test_vllm_guided_fields(server, client, extra, check):
    r = client.completions.create(
        model=server.state.model_name,
        prompt="Answer:",
        max_tokens=extra.pop("max_tokens", 100),
        temperature=1.0,
        seed=1,
        extra_body=extra,
    )
    text, reason = r.choices[0].text, r.choices[0].finish_reason
    if check is None:  # an unbounded JSON object cut at max_tokens reports "length"
        assert text.startswith("{") and reason in ("length", "stop")
        return
    assert reason == "stop", text
    if isinstance(check, str):
        assert re.fullmatch(check, text), text
    else:
        check(text)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": BAD_SCHEMA}},
         "response_format", 'Unsupported type "nope"'),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'json_schema'"),
        ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "(["}, "guided_regex", "invalid regex"),
        ({"guided_grammar": "root ::= nope"}, "guided_grammar", 'Rule "nope" is not defined'),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_problem(server, client, extra, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.state.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body=extra,
        )
    assert e.value.body["param"] == param
    assert message in e.value.body["message"], e.value.body


def test_logit_bias_and_min_tokens(server, client):
    tok = server.state.engine.tokenizer
    forced = tok.encode(" the", add_special_tokens=False)[0]
    r = client.completions.create(
        model=server.state.model_name,
        prompt="Hello",
        max_tokens=6,
        temperature=1.0,
        logit_bias={str(forced): 100},
    )
    assert r.choices[0].text == tok.decode([forced] * 6)
    # End of sequence pushed to +100: min_tokens still holds it back for exactly 5 tokens.
    eos = min(tok.eos_token_ids)
    r = client.completions.create(
        model=server.state.model_name,
        prompt="Hello",
        max_tokens=20,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 5},
    )
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=server.state.model_name, prompt="x", max_tokens=2, logit_bias={"abc": 1}
        )
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError, match="outside this model's vocabulary"):
        client.completions.create(
            model=server.state.model_name, prompt="x", max_tokens=2, logit_bias={"99999": 1}
        )


def test_max_completion_tokens_and_seed(server, client):
    kw = dict(
        model=server.state.model_name,
        messages=[{"role": "user", "content": "Tell me a story"}],
        temperature=1.0,
        seed=1234,
        max_completion_tokens=7,
    )
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.usage.completion_tokens <= 7
    assert a.choices[0].message.content == b.choices[0].message.content


def test_user_is_kept_in_the_usage_record(server, client):
    from loraplex.platform.db.models import UsageRecord

    r = client.completions.create(
        model=server.state.model_name, prompt="Hi", max_tokens=2, user="end-user-42"
    )
    with server.sessions() as session:
        row = session.query(UsageRecord).filter_by(request_id=r.id).one()
    assert row.end_user == "end-user-42" and row.completion_tokens == r.usage.completion_tokens
