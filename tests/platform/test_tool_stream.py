"""Streamed tool calls (tool_choice auto): whatever the split, the same as the whole parse."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.platform.openai.tool_calls import Tool, parse_tool_calls
from loraplex.platform.openai.tool_stream import ToolCallStream

TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": n}})
    for n in ("get_time", "get_weather")
]
TIME = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
WEATHER = '{"name": "get_weather", "parameters": {"city": "Zürich \\"}{", "unit": "celsius"}}'
TEXTS = [
    "The weather is fine.",
    "",
    "  \n",
    # Hermes / Qwen: text then a call, calls only, a list in one body, text between and after
    f"Let me check.\n<tool_call>\n{TIME}\n</tool_call>",
    f"<tool_call>{TIME}</tool_call><tool_call>{WEATHER}</tool_call>\n",
    f"<tool_call>[{TIME}, {WEATHER}]</tool_call>",
    f"\n A <tool_call>{TIME}</tool_call> B\n<tool_call>{WEATHER}</tool_call> C \n",
    f"<tool_call>{TIME}",  # unclosed, stopped at EOS: still a call
    # cut by max_tokens: the cut call is text, the calls before it stand
    f"Checking. <tool_call>{TIME[:30]}",
    f"<tool_call>{TIME}</tool_call>\n<tool_call>{WEATHER[:40]}",
    # not calls: they and all after them are text
    f"<tool_call>{{broken}}</tool_call><tool_call>{TIME}</tool_call>",
    "Use <tool_call> tags to call tools.",
    '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>',
    # looks like the start of a marker, is not one
    "<tools> are listed above; [TOOL] is a tag; <tool_cal",
    "a < b and [TOOL_CALL] [TOOL_CALLS",
    # Mistral
    f"[TOOL_CALLS] [{TIME}, {WEATHER}]",
    f"Sure. [TOOL_CALLS][{TIME}]",
    f"[TOOL_CALLS][{TIME}] and more",
    f"[TOOL_CALLS] not json <tool_call>{TIME}</tool_call>",
    f"<tool_call>{TIME}</tool_call>[TOOL_CALLS][{WEATHER}]",
    # Llama 3.1's python tag, first or after Mistral's marker, and one that is no call
    f"<|python_tag|>{TIME}",
    f"Let me see. <|python_tag|> [{TIME}, {WEATHER}]",
    f"<|python_tag|>{TIME}; {WEATHER}",
    f"<|python_tag|>brave_search.call(query='x') [TOOL_CALLS][{TIME}]",
    f"[TOOL_CALLS] <|python_tag|>{TIME}",
    "<|python_ta",
    # Llama 3 bare JSON (a call or a list), and JSON that is not a call
    f"  {WEATHER}\n",
    f"[{TIME}, {WEATHER}]",
    '{"a": 1}',
    f"{TIME} is the call I would make",
    "[1] is a citation, {x} a set",
    '{"name": "get_time", "arguments": {"q": "<tool_call>"}}',
    f"{TIME[:25]}",
]


def _stream(pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, calls as (name, arguments), content pieces) of a streamed answer, checking
    that each call's deltas come as OpenAI sends them."""
    stream = ToolCallStream(TOOLS)
    content, deltas, sent = "", [], []
    for i, piece in enumerate(pieces):
        new, calls = stream.feed(piece, final=i == len(pieces) - 1)
        content += new
        sent.append(new)
        deltas += calls
    calls = []
    for head, args in zip(deltas[::2], deltas[1::2], strict=True):
        assert head["index"] == args["index"] == len(calls)
        assert head["type"] == "function" and head["id"].startswith("call_")
        assert head["function"]["arguments"] == "" and set(args) == {"index", "function"}
        calls.append((head["function"]["name"], args["function"]["arguments"]))
    return content, calls, sent


def _whole(text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, TOOLS)
    return content or "", [(c.name, c.arguments) for c in calls]


def _split(text: str, cuts) -> list[str]:
    cuts = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("text", TEXTS)
def test_any_split_streams_the_whole_parse(text):
    want = _whole(text)
    assert _stream([text])[:2] == want
    assert _stream(list(text) or [""])[:2] == want  # a character at a time
    for cut in range(1, len(text)):
        assert _stream([text[:cut], text[cut:]])[:2] == want, cut


FRAGMENTS = st.sampled_from(
    ["Hi", " ", "\n", "<tool_call>", "</tool_call>", "<tool", "[TOOL_CALLS]", "[TOOL", TIME,
     "<|python_tag|>", "<|pyth",
     WEATHER, f"[{TIME}]", "{", "}", "[", "]", '"', '{"name": "get_time"', "x"]
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.lists(FRAGMENTS, max_size=7).map("".join), st.lists(st.integers(0, 400), max_size=8))
def test_random_answers_split_anywhere_stream_the_whole_parse(text, cuts):
    assert _stream(_split(text, cuts))[:2] == _whole(text)


def test_content_goes_out_as_written_and_only_a_possible_marker_waits():
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Let me") == ("Let me", [])
    assert stream.feed(" check <tool") == (" check", [])  # " <tool" may open a call
    assert stream.feed("s> first.") == (" <tools> first.", [])
    assert stream.feed("\n<tool_call>") == ("", [])
    assert stream.feed(TIME) == ("", [])
    new, deltas = stream.feed("</tool_call> Then")  # the call, as soon as it closes
    assert new == "\n Then" and [d["index"] for d in deltas] == [0, 0]
    assert json.loads(deltas[1]["function"]["arguments"]) == {"zone": "UTC"}
    assert stream.feed(" more.\n", final=True) == (" more.", [])


def test_a_call_cut_by_max_tokens_comes_out_as_text():
    text = f"Checking.<tool_call>{TIME[:30]}"
    content, calls, sent = _stream(list(text))
    assert (content, calls) == (text, []) == (parse_tool_calls(text, TOOLS)[0], [])
    assert sent[len("Checking.") - 1] == "."  # the text before it was not held back
    assert "".join(sent[:-1]) == "Checking."  # the cut call: text at the end only


def test_parse_keeps_calls_before_a_cut_one_and_leading_space():
    content, calls = parse_tool_calls(f" Hi <tool_call>{TIME}</tool_call><tool_call>{{", TOOLS)
    assert content == " Hi <tool_call>{" and [c.name for c in calls] == ["get_time"]
