"""A raw HTTP/1.1 streaming client that counts every token that reaches its socket.

The `openai` client's `close()` resets the connection and throws away bytes already received,
so "what the client received" is not knowable through it. This client can hang up the way a
careful client does: it half-closes (FIN) after `hang_up_after` tokens and keeps reading until
the server closes, so every event the server wrote is counted.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11


@dataclass
class StreamResult:
    request_id: str | None
    tokens: int  # tokens in complete events received, counted by their logprobs entries
    finished: bool  # saw `data: [DONE]`
    error: dict | None = None  # an `error` event's body, e.g. when the engine died mid-stream
    status: int = 200  # the HTTP status; an error status ends the stream at once


async def stream_completion(
    url: str,
    key: str,
    body: dict,
    hang_up_after: int | None = None,
    on_tokens: Callable[[int], None] | None = None,
    recv_buffer_bytes: int | None = None,
) -> StreamResult:
    """`on_tokens(total)` runs after each event that carried tokens. `recv_buffer_bytes`: a
    small receive buffer, so that a client that stops reading holds the stream back (the
    server's buffers are small too) instead of the kernel taking all of it."""
    u = urlsplit(url)
    if recv_buffer_bytes is None:
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
    else:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer_bytes)  # before connect
        sock.connect((u.hostname, u.port))
        reader, writer = await asyncio.open_connection(sock=sock)
    conn = h11.Connection(h11.CLIENT)
    payload = json.dumps({**body, "stream": True}).encode()
    headers = [
        ("Host", u.netloc),
        ("Authorization", f"Bearer {key}"),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(payload))),
    ]
    writer.write(conn.send(h11.Request(method="POST", target="/v1/completions", headers=headers)))
    writer.write(conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
    result, buf, hung_up = StreamResult(None, 0, False), b"", False
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                if not data:
                    break  # the server closed the connection
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                result.status = event.status_code
                if event.status_code != 200:
                    break
            elif isinstance(event, h11.Data):
                buf += event.data
                while b"\n\n" in buf:
                    raw, buf = buf.split(b"\n\n", 1)
                    data = raw.removeprefix(b"data: ")
                    if data == b"[DONE]":
                        result.finished = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = chunk["error"]
                        continue
                    result.request_id = chunk["id"]
                    before = result.tokens
                    for choice in chunk["choices"]:
                        result.tokens += len((choice.get("logprobs") or {}).get("tokens", []))
                    if on_tokens is not None and result.tokens > before:
                        on_tokens(result.tokens)
                if hang_up_after is not None and result.tokens >= hang_up_after and not hung_up:
                    writer.write_eof()
                    hung_up = True
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
    finally:
        writer.close()
    return result
