"""MeteredEventStream as an ASGI app, driven by hand: the events' generator is closed and the
request ended (`closed`) however the stream stops — also when the client is gone before the
generator ever ran, where its own `finally` (which bills the request) never runs."""

from __future__ import annotations

import asyncio

from loraplex.platform.openai.sse import MeteredEventStream


def _run(send_delay: float, disconnect_at_once: bool) -> tuple[list, list, list]:
    ran, closed, sent = [], [], []

    async def events():
        ran.append("started")
        try:
            for i in range(3):
                yield f"data: {i}\n\n", 1
        finally:
            ran.append("finally")

    async def on_closed() -> None:
        closed.append(True)

    async def send(message) -> None:
        await asyncio.sleep(send_delay)  # a transport that makes the writer wait
        sent.append(message["type"])

    async def receive():
        if not disconnect_at_once:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    stream = MeteredEventStream(events(), lambda n: None, on_closed)
    asyncio.run(stream({"type": "http"}, receive, send))
    return ran, closed, sent


def test_a_client_gone_before_the_first_event_still_ends_the_request():
    ran, closed, sent = _run(send_delay=0.05, disconnect_at_once=True)
    assert ran == []  # the generator never ran: its `finally` could not bill anything
    assert closed == [True]  # but `closed` did, once


def test_a_whole_stream_ends_the_request_once():
    ran, closed, sent = _run(send_delay=0.0, disconnect_at_once=False)
    assert ran == ["started", "finally"] and closed == [True]
    assert sent == ["http.response.start"] + ["http.response.body"] * 4


def test_events_ready_together_go_in_one_write_billed_with_it():
    """`ready`: the next event comes at once (a stream its server fell behind on), so the
    events gather into one body; the tokens are billed per write that reached the client,
    an empty text's tokens with the next write."""
    bodies, billed = [], []
    ready_after = [True, True, False, True, False, False]  # after each of the six events

    async def events():
        for i, (text, tokens) in enumerate(
            [("a", 1), ("b", 1), ("c", 1), ("", 2), ("d", 1), ("e", 0)]
        ):
            now[0] = ready_after[i]
            yield text, tokens

    now = [False]

    async def send(message) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])

    async def receive():
        await asyncio.sleep(3600)

    stream = MeteredEventStream(events(), billed.append, ready=lambda: now[0])
    asyncio.run(stream({"type": "http"}, receive, send))
    assert bodies == [b"abc", b"d", b"e", b""]
    assert billed == [3, 3, 0]
    assert sum(billed) == 6  # every token once


def test_gathered_events_the_client_never_got_are_not_billed():
    billed, bodies = [], []

    async def events():
        for text in ("a", "b", "c"):
            yield text, 1

    async def send(message) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])

    closed = asyncio.Event()

    async def receive():  # the client is gone as soon as the first write went out
        if bodies:
            return {"type": "http.disconnect"}
        await closed.wait()

    stream = MeteredEventStream(events(), billed.append, ready=lambda: True)
    asyncio.run(stream({"type": "http"}, receive, send))
    assert bodies == [b"abc"] and billed == []
