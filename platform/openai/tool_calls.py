"""Function calling on /v1/chat/completions: tools in the prompt, calls out of the text.

In: `tools` (OpenAI function tools) and `tool_choice` (`none`, `auto`, `required`, or
`{"type": "function", "function": {"name": ...}}`). A chat template that knows tools (it uses
the `tools` variable) renders them itself; for one that does not, the tools and earlier calls
and results are written as Hermes-style text (`<tool_call>{...}</tool_call>`,
`<tool_response>...</tool_response>`) into plain system/user/assistant turns.

Out: with `auto` the model's text is parsed by the formats of the common families (Hermes /
Qwen `<tool_call>{json}</tool_call>`, Mistral `[TOOL_CALLS][{...}]`, Llama 3's bare JSON
`{"name": ..., "parameters": {...}}`, also after Llama 3.1's `<|python_tag|>`). The markers
stay in the text although some tokenizers mark them special (`kept_special_tokens`). With
`required` or a named function the grammar forces a JSON array of calls,
`[{"name": ..., "arguments": {...}}]`, valid against each function's parameter schema, so the
answer is always a parseable call, unless max_tokens cuts it: then finish_reason is "length"
and the cut call has the partial arguments written so far, streamed or not.

Streamed: a forced call's `delta.tool_calls` come as it is written, as OpenAI sends them (the
call's index, id, type and name once its name is complete, then its arguments piece by
piece; `ForcedCallStream`); a call cut by max_tokens has streamed partial arguments and ends
with finish_reason "length". With `auto` the content streams as it is written and each call
comes once its text parses (`ToolCallStream`, platform/openai/tool_stream.py), so a stream
adds up to the unstreamed answer, a call cut by max_tokens included (text, in both).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.platform.errors import APIError

_STRICT = ConfigDict(extra="forbid", strict=True)


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # a forced call is grammar-checked either way


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class _Named(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: _Named


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def public(self, index: int | None = None) -> dict:
        out = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def _parameters(f: FunctionDef) -> dict:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


def resolve_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> str | None:
    """'auto', 'required', a function's name, or None (no tools in play); 400 if inconsistent."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "invalid_value", "tool_choice")
        return None
    if choice is None:
        return "auto"
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names function {choice.function.name!r}, which is not in tools "
                f"({', '.join(names)})",
                "invalid_value",
                "tool_choice",
            )
        return choice.function.name
    return choice


def forced_calls_schema(tools: list[Tool], choice: str, parallel: bool = True) -> dict:
    """The JSON schema of the array of calls a `required` / named tool_choice must produce
    (one call for a named function or with parallel_tool_calls false)."""
    chosen = [t.function for t in tools if choice == "required" or t.function.name == choice]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": _parameters(f)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": item, "minItems": 1}
    if choice != "required" or not parallel:
        schema["maxItems"] = 1
    return schema


def tool_preamble(tools: list[Tool]) -> str:
    """The system text that describes the tools to a model whose template has no tool support."""
    compact = (",", ":")  # every token of the preamble is prompt the tenant pays for
    specs = "\n".join(
        json.dumps(t.function.model_dump(exclude_none=True), separators=compact) for t in tools
    )
    return (
        f"Tools:\n<tools>\n{specs}\n</tools>\n"
        'To call one: <tool_call>{"name":...,"arguments":{...}}</tool_call>'
    )


def plain_tool_messages(messages: list[dict], tools: list[Tool] | None) -> list[dict]:
    """`messages` as plain system/user/assistant turns for templates that know no tools."""
    out: list[dict] = []
    if tools:
        out.append({"role": "system", "content": tool_preamble(tools)})
    for m in messages:
        if m["role"] == "tool":
            body = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_resp"):
                out[-1]["content"] += "\n" + body
            else:
                out.append({"role": "user", "content": body})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(
                "<tool_call>"
                + json.dumps({"name": c["function"]["name"], "arguments": _args(c)})
                + "</tool_call>"
                for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools and len(out) > 1 and out[1]["role"] == "system":  # one system turn, tools first
        out[0:2] = [{"role": "system", "content": out[0]["content"] + "\n\n" + out[1]["content"]}]
    return out


def _args(call: dict) -> Any:
    raw = call["function"].get("arguments") or "{}"
    try:
        return json.loads(raw)
    except (TypeError, json.JSONDecodeError):
        return raw


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for a tool-aware template: tool_calls' arguments as objects, as HF expects."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {"name": c["function"]["name"], "arguments": _args(c)}}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


# ------------------------------------------------------------------------------- parsing
HERMES_OPEN, HERMES_CLOSE, MISTRAL = "<tool_call>", "</tool_call>", "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1+: a JSON call (or a list) follows, nothing else
TAIL_MARKERS = (MISTRAL, PYTHON_TAG)  # all that follows one must be the calls
TOOL_MARKERS = (HERMES_OPEN, HERMES_CLOSE, *TAIL_MARKERS)


def find_tail_marker(text: str, start: int = 0) -> tuple[int, int]:
    """(position, length) of the first of TAIL_MARKERS in text[start:]; (-1, 0) if none."""
    found = [(i, len(m)) for m in TAIL_MARKERS if (i := text.find(m, start)) >= 0]
    return min(found) if found else (-1, 0)


def _call_from(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def calls_in(text: str, names: set[str]) -> list[ToolCall] | None:
    """The calls `text` holds as one JSON value (a call or a list of calls), or None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call_from(v, names) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls


def parse_tool_calls(text: str, tools: list[Tool]) -> tuple[str | None, list[ToolCall]]:
    """(content outside the calls or None, the calls) from a model's whole answer.

    - The answer (stripped) is one JSON call or list of calls: Llama 3's format.
    - Else the first marker decides. `<tool_call>` (Hermes / Qwen): each `<tool_call>body
      </tool_call>` (the last may be unclosed) whose body is a call or list of calls is one;
      from the first body that is not, the text is content (so a call cut by max_tokens is
      text, and the calls before it stand). `[TOOL_CALLS]` (Mistral) or `<|python_tag|>`
      (Llama 3.1): all that follows it must be a call or a list of calls.
    - Without calls the content is the text as written; with calls it is the text outside
      them, trailing whitespace stripped (None when empty).

    Every rule is decided by a prefix of the answer and what follows it, never by text
    before it: `ToolCallStream` (platform/openai/tool_stream.py) streams the same result.
    """
    names = {t.function.name for t in tools}
    stripped = text.strip()
    if stripped.startswith(("{", "[")) and (found := calls_in(stripped, names)):
        return None, found
    hermes, (tail, length) = text.find(HERMES_OPEN), find_tail_marker(text)
    if tail >= 0 and not 0 <= hermes < tail:
        found = calls_in(text[tail + length :].strip(), names)
        return (text[:tail].rstrip() or None, found) if found else (text, [])
    outside, calls, pos = [], [], 0
    while (start := text.find(HERMES_OPEN, pos)) >= 0:
        body = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body)
        found = calls_in(text[body : end if end >= 0 else len(text)].strip(), names)
        if found is None:
            break
        outside.append(text[pos:start])
        calls += found
        pos = len(text) if end < 0 else end + len(HERMES_CLOSE)
    if not calls:
        return text, []
    outside.append(text[pos:])
    return "".join(outside).rstrip() or None, calls


_FORCED_HEAD = re.compile(r'\{"name":\s*"([A-Za-z0-9_-]+)",\s*"arguments":\s*')


def scan_forced_calls(text: str) -> list[tuple[str, str, bool]]:
    """(name, arguments as written, complete) of each call in a forced answer, so far.

    A forced answer is the grammar's JSON array `[{"name": .., "arguments": {..}}, ..]`
    (properties in the schema's order); `text` may stop anywhere in it. A call appears once its
    name is complete; its arguments grow as `text` does (each a prefix of the final ones).
    """
    calls: list[tuple[str, str, bool]] = []
    pos = 1 if text.startswith("[") else len(text)
    while pos < len(text):
        head = _FORCED_HEAD.match(text, pos)
        if head is None:
            break
        start = end = head.end()
        depth, in_str, escaped = 0, False, False
        for end in range(start, len(text)):
            ch = text[end]
            if in_str:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    break
        done = depth == 0 and end > start
        calls.append((head.group(1), text[start : end + 1], done))
        if not done:
            break
        pos = end + 1
        while pos < len(text) and text[pos] in "}], ":  # to the next call's "{"
            pos += 1
    return calls


class ForcedCallStream:
    """The streamed `delta.tool_calls` of a forced answer: each call's id, type and name once
    its name is written, then its arguments piece by piece, as OpenAI streams them."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[ToolCall] = []  # calls begun, arguments as sent so far

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        deltas = []
        for i, (name, args, _) in enumerate(scan_forced_calls(self.text)):
            if i == len(self.calls):
                self.calls.append(ToolCall(name, ""))
                deltas.append({**self.calls[i].public(i)})
            call = self.calls[i]
            if len(args) > len(call.arguments):
                new, call.arguments = args[len(call.arguments) :], args
                if deltas and deltas[-1]["index"] == i:
                    deltas[-1]["function"]["arguments"] += new
                else:
                    deltas.append({"index": i, "function": {"arguments": new}})
        return deltas
