"""JSON bodies must be text: UTF-8, and no lone UTF-16 surrogate in a string.

JSON may spell a lone surrogate as an escape (`"\\ud800"`); Python's `json` and pydantic accept
it, and the string then fails far from the request, wherever it is first encoded (the registry,
the tokenizer, a log line), as a 500. Refusing such a body once, before any route reads it,
keeps every route and everything behind them free of strings that are not text.
"""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.errors import error_body

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
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        why = _not_text(body)
        if why is None:
            await self.app(scope, _replay([{"type": "http.request", "body": body}], receive), send)
            return
        payload = json.dumps(error_body(400, why, "invalid_json")).encode()
        await send({"type": "http.response.start", "status": 400,
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
