"""Tool calls streamed with `tool_choice: "auto"`: content as it is written, each call once
it is decided, agreeing with the whole-text parse (`parse_tool_calls`) for any split.

Text goes out as `delta.content` unless it might still belong to a call: a partial marker
(`<tool_ca` at the end), trailing whitespace (stripped from the content when calls follow),
an answer that opens like JSON (it may be one bare Llama 3 call), the body of a call. A call
goes out once its text parses (Hermes: at `</tool_call>`; Mistral and bare JSON: when the
answer ends, since nothing may follow them), as OpenAI streams calls: a chunk with its index,
id, type and name (arguments ""), then one with its arguments. A call that never parses (cut
by max_tokens, not JSON, an unknown function) is content from its marker on, as in the
unstreamed answer: a call's pieces are sent only once it can no longer turn into text.
"""

from __future__ import annotations

from loraplex.platform.openai.tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    TAIL_MARKERS,
    Tool,
    ToolCall,
    calls_in,
    find_tail_marker,
)

_MARKERS = (HERMES_OPEN, *TAIL_MARKERS)


class _JSONEnd:
    """Where the JSON object or array starting at `start` closes, scanned as the text grows."""

    def __init__(self, start: int) -> None:
        self.i, self.depth, self.in_str, self.escaped = start, 0, False, False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        while self.end is None and self.i < len(text):
            ch = text[self.i]
            self.i += 1
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.i
        return self.end


def _could_be_calls(head: str) -> bool:
    """Whether JSON that starts with `head` may still be a call or a list of calls."""
    head = head.lstrip()
    if head.startswith("["):
        head = head[1:].lstrip()
    for expected in '{"':
        if not head:
            return True
        if head[0] != expected:
            return False
        head = head[1:].lstrip()
    return True


def _partial_marker(text: str, pos: int, markers: tuple[str, ...]) -> int:
    """Length of the longest end of text[pos:] that begins one of `markers`."""
    for k in range(min(max(map(len, markers)) - 1, len(text) - pos), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class ToolCallStream:
    """Feed the answer's text as it comes; get (new content, tool-call deltas) back.

    Each delta is one entry of a chunk's `delta.tool_calls` and goes in its own chunk.
    """

    def __init__(self, tools: list[Tool]) -> None:
        self.names = {t.function.name for t in tools}
        self.text = ""
        self.calls: list[ToolCall] = []
        # start (leading space, or JSON that may be a bare call) | text (outside calls) |
        # body (of a Hermes call) | mistral (after a tail marker: Mistral's, Llama's python tag) |
        # content (rest is text) | done
        self.mode = "start"
        self.pos = 0  # text[:pos] is decided
        self.marker = 0  # where the call being read began
        self.outside = ""  # decided text outside calls
        self.sent = 0  # characters of content sent
        self.bare: _JSONEnd | None = None

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        """`final`: the answer ends with `piece`; whatever is still held is decided."""
        self.text += piece
        first = len(self.calls)
        self._advance(final)
        # Without calls the content is the answer as written; with them, trailing space goes.
        content = self.text if final and not self.calls else self.outside.rstrip()
        new, self.sent = content[self.sent :], max(self.sent, len(content))
        deltas: list[dict] = []
        for i, call in enumerate(self.calls[first:], first):
            head = {"name": call.name, "arguments": ""}
            deltas.append({"index": i, "id": call.id, "type": "function", "function": head})
            deltas.append({"index": i, "function": {"arguments": call.arguments}})
        return new, deltas

    def _advance(self, final: bool) -> None:
        text = self.text
        while True:
            if self.mode == "start":
                rest = text.lstrip()
                if not rest and not final:
                    return
                if not rest or rest[0] not in "{[" or not _could_be_calls(rest[:64]):
                    self.mode = "text"
                    continue
                if self.bare is None:
                    self.bare = _JSONEnd(len(text) - len(rest))
                end = self.bare.scan(text)
                if end is None or not text[end:].strip():
                    found = calls_in(text.strip(), self.names) if final else None
                    if found:
                        self.calls += found
                        self.mode, self.pos = "done", len(text)
                    elif final or end is not None and calls_in(text.strip(), self.names) is None:
                        self.mode = "text"
                        continue
                    return
                self.mode = "text"  # text after the JSON: not a bare call
            elif self.mode == "text":
                hermes = text.find(HERMES_OPEN, self.pos)
                tail, length = (-1, 0) if self.calls else find_tail_marker(text, self.pos)
                if tail >= 0 and not 0 <= hermes < tail:
                    self._enter("mistral", tail, length)
                elif hermes >= 0:
                    self._enter("body", hermes, len(HERMES_OPEN))
                else:
                    markers = (HERMES_OPEN,) if self.calls else _MARKERS
                    safe = len(text) - (0 if final else _partial_marker(text, self.pos, markers))
                    self.outside += text[self.pos : safe]
                    self.pos = safe
                    return
            elif self.mode in ("body", "mistral"):
                rest = text[self.pos :].lstrip()
                if rest and rest[0] not in "{[":  # neither a call nor a list of calls
                    self.mode, self.pos = "content", self.marker
                    continue
                close = text.find(HERMES_CLOSE, self.pos) if self.mode == "body" else -1
                if close < 0 and not final:
                    return
                found = calls_in(text[self.pos : close if close >= 0 else None].strip(), self.names)
                if found is None:
                    self.mode, self.pos = "content", self.marker
                    continue
                self.calls += found
                self.mode = "text" if close >= 0 else "done"
                self.pos = close + len(HERMES_CLOSE) if close >= 0 else len(text)
            elif self.mode == "content":
                self.outside += text[self.pos :]
                self.pos = len(text)
                return
            else:  # done: a bare or Mistral answer is over once it parses
                return

    def _enter(self, mode: str, marker: int, length: int) -> None:
        self.outside += self.text[self.pos : marker]
        self.mode, self.marker, self.pos = mode, marker, marker + length
