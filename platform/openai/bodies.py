"""JSON bodies must be text (UTF-8, no lone UTF-16 surrogate in a string), of bounded size
and nesting.

JSON may spell a lone surrogate as an escape (`"\\ud800"`); Python's `json` and pydantic accept
it, and the string then fails far from the request, wherever it is first encoded (the registry,
the tokenizer, a log line), as a 500. Refusing such a body once, before any route reads it,
keeps every route and everything behind them free of strings that are not text.

Nesting deeper than MAX_JSON_DEPTH arrays and objects is refused (400 `json_too_deep`) before
anything parses it: Python's parser, pydantic and every recursive walk over a value fail deep
documents with RecursionError, a 500 (`[[[[...]]]]` of 100,000 levels is 200 kB). A body past
MAX_JSON_BODY_BYTES is refused (413 `too_large`) as it arrives, before it is all in memory.
Uploaded JSON documents (adapter_config.json, a safetensors header) take the same depth check
(`check_json_depth`, platform/uploads/validate.py).
"""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.errors import error_body

# Deeper than any request or schema we serve; far below Python's recursion limit.
MAX_JSON_DEPTH = 64
# The largest JSON request body (a long prompt as token ids is well under a megabyte).
MAX_JSON_BODY_BYTES = 32 * 1024**2
# A JSON string (its escapes skipped) or one bracket: what depth is counted from.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_OPEN = frozenset(b"[{")
# A surrogate escape anywhere (a valid pair included): the cheap test before the real one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";")[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True  # FastAPI reads a body without a content type as JSON


def _has_lone_surrogate(value: object) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def json_depth(raw: bytes | str) -> int:
    """How deeply arrays and objects nest in JSON text (0: a scalar), brackets inside strings
    not counted; read without parsing, so any depth is safe to measure. Malformed text gets
    some number, left to the parser to refuse."""
    data = raw.encode() if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= 1:
        return data.count(b"[") + data.count(b"{")
    depth = deepest = 0
    for m in _TOKENS.finditer(data):
        c = data[m.start()]
        if c in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif c != 0x22:  # a closing bracket (0x22: a string)
            depth -= 1
    return deepest


def check_json_depth(raw: bytes | str, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Why `raw` nests too deeply to be parsed safely, or None. Cheap when it holds fewer
    brackets than `limit`, as nearly every document does."""
    data = raw.encode() if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= limit:
        return None
    depth = json_depth(data)
    if depth <= limit:
        return None
    return f"the JSON nests {depth} arrays/objects deep; at most {limit} are accepted"


def _not_text(body: bytes) -> str | None:
    """Why `body` is not JSON text, or None (malformed JSON is left to the route's parser)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "the body is not valid JSON: it must be UTF-8 text"
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if _has_lone_surrogate(value):
        return "the body holds a lone UTF-16 surrogate escape (such as \\ud800), which is not text"
    return None


class TextOnlyJSONBodies:
    """ASGI middleware: a JSON request whose body is not text gets 400 `invalid_json`."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks, more, size = [], True, 0
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_JSON_BODY_BYTES:
                why = f"the JSON body exceeds the limit of {MAX_JSON_BODY_BYTES} bytes"
                await _refuse(send, 413, why, "too_large")
                return
            more = message.get("more_body", False)
        body = b"".join(chunks)
        deep = check_json_depth(body)
        if deep is not None:
            await _refuse(send, 400, deep, "json_too_deep")
            return
        why = _not_text(body)
        if why is None:
            await self.app(scope, _replay([{"type": "http.request", "body": body}], receive), send)
            return
        await _refuse(send, 400, why, "invalid_json")


async def _refuse(send: Send, status: int, why: str, code: str) -> None:
    payload = json.dumps(error_body(status, why, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": payload})


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    """`receive` that gives `messages` first, then what `then` gives (a disconnect, later)."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
