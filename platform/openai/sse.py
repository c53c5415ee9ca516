"""A server-sent-events response that meters what it delivers.

Billing counts the tokens a client was sent, so an event's tokens must count only if the
server really handed the event to an open connection. uvicorn's `send` does not say: once it
knows the peer has gone it drops body messages silently (ASGI spec 2.3), and asyncio's
transport drops writes made after it closed on the peer's FIN but before uvicorn hears of it
(`connection_lost` is queued with `call_soon`). So after each `send` we let the loop run one
turn, which runs any `connection_lost` queued before our write, and then look, without
yielding again, whether uvicorn saw the connection close. Closed: the event was dropped; open:
it was written (a close queued after our write comes after our look).

What a client receives is then exact for any client that keeps reading until the server closes
(a half-close, as our ledger test does). A client that resets the connection may lose events
that were already written to its socket; those are billed, as they were sent. This reasoning
holds for uvicorn on asyncio's default loop, which is what `loraplex serve` runs.

Events that are ready together go out in one write (`ready`: the next event will come without
waiting, e.g. a server that fell behind the engine has several of a stream's outputs queued):
still one event per token in the body, but one `send`, one loop turn and one look per write
instead of per event, so a loaded server catches up instead of falling further behind. Their
tokens are billed together, as the write that carried them reached an open connection or not.

A client that stops reading: uvicorn's `send` waits (before writing) while the transport's
buffer is over its high-water mark, so the events pile up in the engine's queue instead, where
the request pauses (engine/process/async_engine.py, `stream_window_tokens`). What was written
ahead of the client is bounded by the transport's buffer and the kernel's socket buffers
(`loraplex serve` sets a small SO_SNDBUF); those events are billed, as they were sent. A `send`
that waits longer than `stall_timeout_s` ends the stream unfinished, billed for what was
written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("loraplex.requests")
GATHER = 64  # events at most in one write: a lagging stream still goes out in steady pieces
HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies (nginx ingress) must not hold events back
]


def connection_closed_now(receive: Receive) -> bool:
    """Whether the client is known to be gone, decided without yielding to the event loop.

    uvicorn's `receive()` returns `http.disconnect` at once when the connection is closed and
    otherwise waits; we run it one step and drop it if it would wait.
    """
    step = receive()
    try:
        step.send(None)
    except StopIteration as done:
        return done.value.get("type") == "http.disconnect"
    step.close()
    return False


class MeteredEventStream(Response):
    """Streams `(event_text, tokens)` pairs.

    `delivered(tokens)` is called for each write that reached an open connection; an empty
    text carries its tokens over to the next event. While `ready()` says the next event will
    come at once, events gather into one write (at most `GATHER` of them). It must say False
    at the last event: what is still gathered when the generator ends is written after its
    `finally` ran (AnswerStream's bills the request there).

    The generator is closed (running its `finally`) when the stream ends, fails, or the client
    goes away, also while it waits for the engine; then `closed()` runs, also for a generator
    that never started (a client gone before the first event), whose `finally` never runs.
    A client that accepts nothing for `stall_timeout_s` is given up on like one that went away.
    """

    def __init__(
        self,
        events: AsyncGenerator[tuple[str, int], None],
        delivered: Callable[[int], None],
        closed: Callable[[], Awaitable[None]] | None = None,
        stall_timeout_s: float | None = None,
        ready: Callable[[], bool] | None = None,
    ):
        super().__init__(media_type="text/event-stream")  # FastAPI passes a Response through
        self.events, self.delivered, self.closed = events, delivered, closed
        self.stall_timeout_s = stall_timeout_s
        self.ready = ready

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.create_task(self._pump(receive, send))
        gone = asyncio.create_task(self._until_disconnect(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            pump.cancel()  # a no-op once it has finished
            await asyncio.wait({pump})  # its `finally` bills the request
        if not pump.cancelled():
            pump.result()  # re-raise what went wrong while streaming

    async def _pump(self, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            pending = 0  # tokens whose text is held back (e.g. half a UTF-8 character)
            texts: list[str] = []  # events gathered for one write
            async for text, tokens in self.events:
                pending += tokens
                if text:
                    texts.append(text)
                if not texts or (self.ready and self.ready() and len(texts) < GATHER):
                    continue
                if not await self._write(texts, receive, send):
                    return
                self.delivered(pending)
                texts, pending = [], 0
            if texts:
                if not await self._write(texts, receive, send):
                    return
                self.delivered(pending)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            try:
                await self.events.aclose()
            finally:
                if self.closed is not None:
                    await self.closed()

    async def _write(self, texts: list[str], receive: Receive, send: Send) -> bool:
        """Write `texts` in one body message; whether they reached an open connection."""
        body = "".join(texts).encode()
        message = {"type": "http.response.body", "body": body, "more_body": True}
        try:
            # Cancelled while it waits for the transport, the events were not written.
            async with asyncio.timeout(self.stall_timeout_s):
                await send(message)
        except TimeoutError:
            log.warning("stream ended: its client read nothing for %ss", self.stall_timeout_s)
            return False
        # One loop turn lets an already-queued connection_lost run (see module doc).
        await asyncio.sleep(0)
        return not connection_closed_now(receive)

    @staticmethod
    async def _until_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
