"""Function calling through the official `openai` client, and the tool-call parsers."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from loraplex.platform.openai.tool_calls import (
    ForcedCallStream,
    Tool,
    parse_tool_calls,
    plain_tool_messages,
    scan_forced_calls,
)
from tests.utils.server import run_server, upload_adapter

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(
        tiny_models["llama"], tmp_path_factory.mktemp("tools"), max_model_len=512
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server, tiny_adapters):
    _, key = server.new_tenant("tools")
    r = upload_adapter(server.url, key, "qv", tiny_adapters["llama"]["qv4"])
    assert r.status_code == 201, r.text
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("model", ["base", "qv"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_always_yields_a_valid_call(server, client, model, seed):
    r = client.chat.completions.create(
        model=server.state.model_name if model == "base" else model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_completion_tokens=120,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content is None
    assert len(r.choices[0].message.tool_calls) == 1
    _check_calls(r.choices[0].message.tool_calls)


def test_parallel_calls_are_valid_or_cut_by_length(server, client):
    # A random model may keep adding calls: a cut answer reports "length", and its last call
    # has partial arguments (as OpenAI's API answers); the others are whole.
    for seed in range(3):
        r = client.chat.completions.create(
            model=server.state.model_name,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_completion_tokens=120,
        )
        choice = r.choices[0]
        if choice.finish_reason == "length":
            assert choice.message.content is None
            for call in (choice.message.tool_calls or [])[:-1]:
                jsonschema.validate(
                    json.loads(call.function.arguments), SCHEMAS[call.function.name]
                )
        else:
            assert choice.finish_reason == "tool_calls"
            _check_calls(choice.message.tool_calls)


def test_forced_calls_stream_piecewise_and_match_the_unstreamed_answer(server, client):
    kw = dict(
        model=server.state.model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # a random model's array of calls may run to max_tokens
        temperature=1.0,
        seed=4,
        max_completion_tokens=120,
    )
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # As OpenAI streams them: a call's id, type and name first, then its arguments in pieces.
    calls: dict[int, dict] = {}
    pieces = 0
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and not d.function.name
            calls[d.index]["arguments"] += d.function.arguments or ""
            pieces += 1
    assert sorted(calls) == list(range(len(calls))) and pieces > len(calls)
    got = [(c["name"], c["arguments"]) for c in calls.values()]
    want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert got == want  # same seed: the same calls, argument text for argument text
    for name, arguments in got:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("max_tokens", [14, 40, 52])
def test_a_forced_call_cut_by_max_tokens_is_the_same_streamed_or_not(server, client, max_tokens):
    kw = dict(model=server.state.model_name, messages=ASK, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, temperature=1.0, seed=4,
              max_completion_tokens=max_tokens)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    streamed: dict[int, list[str]] = {}
    reason = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            assert not choice.delta.content
            for d in choice.delta.tool_calls or []:
                streamed.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments
    assert reason == "length"
    assert [tuple(v) for v in streamed.values()] == want
    assert bool(want) == (max_tokens > 14)  # 14 tokens do not reach the function's name
    for _, arguments in want:  # the arguments written before the cut
        with pytest.raises(json.JSONDecodeError):
            json.loads(arguments)


def test_named_function_streamed(server, client):
    stream = client.chat.completions.create(
        model=server.state.model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0,
        seed=4,
        max_completion_tokens=120,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0} and deltas[0].function.name == "get_time"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), TIME)


def test_round_trip_call_result_answer(server, client):
    first = client.chat.completions.create(
        model=server.state.model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_completion_tokens=120,
        temperature=0,
    )
    message = first.choices[0].message
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    messages = [
        *ASK,
        message.model_dump(exclude_none=True),  # the assistant turn, sent back as the client has it
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})},
    ]
    answer = client.chat.completions.create(
        model=server.state.model_name,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_completion_tokens=8,
        temperature=0,
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")
    plain = client.chat.completions.create(
        model=server.state.model_name, messages=ASK, max_completion_tokens=1
    )
    # The call and its result are in the prompt (as plain turns for this template).
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_auto_returns_text_when_the_model_calls_nothing(server, client):
    r = client.chat.completions.create(
        model=server.state.model_name, messages=ASK, tools=TOOLS, max_completion_tokens=6
    )
    choice = r.choices[0]
    assert choice.finish_reason != "tool_calls" or choice.message.tool_calls
    if choice.message.tool_calls is None:
        assert isinstance(choice.message.content, str)


@pytest.mark.parametrize(
    ("kw", "param", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not in tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
          "tool_choice": "required"}, "tools", "tools: invalid json_schema"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "cannot be combined"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s(server, client, kw, param, message):
    body = {"tools": TOOLS, **kw}
    if body["tools"] is None:
        del body["tools"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.state.model_name, messages=ASK, max_completion_tokens=4, **body
        )
    assert e.value.body["param"] == param and message in e.value.body["message"], e.value.body


TOOL_OBJS = [Tool.model_validate(t) for t in TOOLS]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        # Hermes / Qwen 2.5+
        ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
         "</tool_call>", "Let me check.", [("get_time", {"zone": "UTC"})]),
        ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
         "</tool_call>", None,
         [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
        # Mistral
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}}]', None,
         [("get_time", {"zone": "CET"})]),
        # Llama 3.1's python tag before its JSON call (one, or a list)
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', None,
         [("get_time", {"zone": "UTC"})]),
        ('On it.<|python_tag|> [{"name": "get_time", "parameters": {"zone": "UTC"}}]', "On it.",
         [("get_time", {"zone": "UTC"})]),
        ("<|python_tag|>brave_search.call(query='x')", "<|python_tag|>brave_search.call(query='x')",
         []),
        # Llama 3.x JSON, with "parameters"
        ('{"name": "get_time", "parameters": {"zone": "UTC"}}', None,
         [("get_time", {"zone": "UTC"})]),
        # not calls: plain text, an unknown function, broken JSON
        ("The weather is fine.", "The weather is fine.", []),
        ('{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', []),
        ('<tool_call>{"name": "get_time", "argu', '<tool_call>{"name": "get_time", "argu', []),
    ],
)  # fmt: skip
def test_parsers(text, content, calls):
    got_content, got = parse_tool_calls(text, TOOL_OBJS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_tool_turns_become_plain_turns_for_templates_without_tools():
    messages = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]  # fmt: skip
    out = plain_tool_messages(messages, TOOL_OBJS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert "get_weather" in out[0]["content"] and out[0]["content"].endswith("Be brief.")
    assert out[2]["content"] == (
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    assert out[3]["content"] == "<tool_response>\n12:00\n</tool_response>"


def test_forced_call_scanner_streams_every_call_of_an_array_in_pieces():
    full = ('[{"name": "get_weather", "arguments": {"city": "Pa}r\\"is", "n": [1, {"a": 2}]}}, '
            '{"name": "get_time", "arguments": {}}]')  # fmt: skip
    stream = ForcedCallStream()
    deltas = [d for i in range(0, len(full), 3) for d in stream.feed(full[i : i + 3])]
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in heads] == [(0, "get_weather"),
                                                                    (1, "get_time")]  # fmt: skip
    joined = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i)
              for i in (0, 1)]  # fmt: skip
    assert [json.loads(a) for a in joined] == [c["arguments"] for c in json.loads(full)]
    assert [(n, a, done) for n, a, done in scan_forced_calls(full)] == [
        ("get_weather", joined[0], True), ("get_time", joined[1], True)]  # fmt: skip
    # Cut anywhere: every call seen so far has a prefix of its final arguments.
    for cut in range(len(full)):
        for (_, args, _), want in zip(scan_forced_calls(full[:cut]), joined, strict=False):
            assert want.startswith(args)


CALL_TIME = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
CALL_WEATHER = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
AUTO_ANSWERS = {  # what the model is made to write (guided_choice), by case
    "text-then-call": f"Let me check the time first.\n<tool_call>{CALL_TIME}</tool_call>",
    "call-only": f"<tool_call>\n{CALL_WEATHER}\n</tool_call>",
    "several-calls": f"<tool_call>{CALL_TIME}</tool_call>\n<tool_call>{CALL_WEATHER}</tool_call>",
    "mistral": f"[TOOL_CALLS] [{CALL_TIME}, {CALL_WEATHER}]",
    "llama-json": CALL_WEATHER,
    "not-a-marker": "The <tools> are [TOOL] tags, <tool_cal and all.",
}


# Short tool specs: the tiny model's 512 positions hold the prompt and the answer.
AUTO_TOOLS = [{"type": "function", "function": {"name": n}} for n in SCHEMAS]


def _auto(client, server, answer: str, stream: bool, max_tokens: int = 300):
    return client.chat.completions.create(
        model=server.state.model_name,
        messages=ASK,
        tools=AUTO_TOOLS,  # tool_choice: auto (the default with tools)
        temperature=1.0,
        seed=7,
        max_completion_tokens=max_tokens,
        stream=stream,
        extra_body={"guided_choice": [answer]},
    )


def _collect(stream) -> tuple[str, list[tuple[str, str]], str, list[str]]:
    """(content, calls, finish_reason, kind of each chunk) of a stream, checking its calls'
    chunks are as OpenAI's: the first of a call has index, id, type, name; then arguments."""
    content, calls, reason, kinds = "", {}, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, reason = chunk.choices[0].delta, chunk.choices[0].finish_reason or reason
        if delta.content:
            content += delta.content
            kinds.append("content")
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.index == len(calls) and d.id.startswith("call_") and d.type == "function"
                assert d.function.name and d.function.arguments == ""
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments
            kinds.append("call")
    return content, [tuple(c) for c in calls.values()], reason, kinds


@pytest.mark.parametrize("case", AUTO_ANSWERS)
def test_auto_streamed_equals_the_whole_answer(server, client, case):
    whole = _auto(client, server, AUTO_ANSWERS[case], stream=False).choices[0]
    content, calls, reason, kinds = _collect(_auto(client, server, AUTO_ANSWERS[case], True))
    assert reason == whole.finish_reason
    assert content == (whole.message.content or "")
    want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert calls == want  # argument text for argument text
    assert bool(calls) == (case != "not-a-marker")
    assert reason == ("tool_calls" if calls else "stop")
    if case == "text-then-call":
        # The words came token by token before the call, not in one piece at the end.
        assert kinds.count("content") > 3 and kinds.index("call") > kinds.index("content")
        assert content == "Let me check the time first."
    if case == "not-a-marker":
        assert content == AUTO_ANSWERS[case] and kinds.count("content") > 3


def test_auto_call_cut_by_max_tokens_streams_as_the_whole_answer(server, client):
    answer = f"Let me check.<tool_call>{CALL_TIME}</tool_call><tool_call>{CALL_WEATHER}"
    r = _auto(client, server, answer, stream=False)
    full = r.usage.completion_tokens
    assert r.choices[0].finish_reason == "tool_calls"
    cuts = range(2, full, 3)  # same seed: the same tokens, cut anywhere

    def whole_and_streamed(max_tokens):
        whole = _auto(client, server, answer, False, max_tokens).choices[0]
        return whole, _collect(_auto(client, server, answer, True, max_tokens))

    # The cuts at once (the server batches them); each cut's two answers are checked below.
    with ThreadPoolExecutor(len(cuts)) as pool:
        answers = list(pool.map(whole_and_streamed, cuts))
    seen = set()
    for max_tokens, (whole, (content, calls, reason, _)) in zip(cuts, answers, strict=True):
        assert whole.finish_reason == reason == "length"
        assert content == (whole.message.content or "")
        want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert calls == want, max_tokens
        names = tuple(name for name, _ in calls)
        # A cut call is text (as the unstreamed answer has it); the calls before it stand.
        if names:
            assert names == ("get_time",) and content.startswith("Let me check.")
            assert f"<tool_call>{CALL_WEATHER}".startswith(content.removeprefix("Let me check."))
        else:
            assert answer.startswith(content)
        seen.add((names, "<tool_call>" in content))
    assert {((), True), (("get_time",), True)} <= seen  # each call was cut at least once


def test_a_marker_the_tokenizer_calls_special_reaches_the_parser(tiny_models, tmp_path):
    """Mistral's tokenizers mark `[TOOL_CALLS]` special, and special tokens are left out of
    the text: with tools (auto) the tool-call markers are kept, so the parser sees them."""
    from tests.engine.test_tokenizer import with_special_marker

    model = tmp_path / "model"
    marker = with_special_marker(tiny_models["llama"], model)
    with run_server(model, tmp_path / "data", max_model_len=512) as srv:
        _, key = srv.new_tenant("marker")
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)

        def ask(**kw):
            return client.chat.completions.create(
                model=srv.state.model_name, messages=ASK, max_completion_tokens=1,
                logit_bias={str(marker): 100}, **kw,
            ).choices[0]  # fmt: skip

        # The marker with nothing after it is no call: the answer is its text, as written.
        assert ask(tools=AUTO_TOOLS).message.content == "[TOOL_CALLS]"
        assert ask().message.content == ""  # without tools it is dropped as before
        assert ask(tools=AUTO_TOOLS, tool_choice="none").message.content == ""
        streamed = client.chat.completions.create(
            model=srv.state.model_name, messages=ASK, max_completion_tokens=1,
            logit_bias={str(marker): 100}, tools=AUTO_TOOLS, stream=True,
        )  # fmt: skip
        assert _collect(streamed)[0] == "[TOOL_CALLS]"
