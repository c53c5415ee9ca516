"""A stream whose client stops reading: its request pauses in the engine once a window of
tokens waits unsent (no steps spent on it, its KV kept), resumes when the client reads again,
and is ended after `stream_stall_timeout_s`; its bill is what was written to its connection.

Against a real server on a real socket made as `loraplex serve` makes it (tests/utils/server.py),
with a raw HTTP client that can stop reading and read again."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import pytest
from sqlalchemy import select

from loraplex.platform.db.models import UsageRecord
from tests.utils.server import run_server

WINDOW = 8
STALL_TIMEOUT_S = 3.0
MAX_TOKENS = 200
SMALL_BUFFER = 4096  # the server's send buffers and the client's receive buffer
# Tokens the engine may make after the window is full, while the pause travels to it (one
# coalesced output and the step in flight on either side).
PAUSE_LAG = 24


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(
        tiny_models["llama"],
        tmp_path_factory.mktemp("data"),
        stream_window_tokens=WINDOW,
        stream_stall_timeout_s=STALL_TIMEOUT_S,
        stream_send_buffer_bytes=SMALL_BUFFER,
    ) as srv:
        yield srv


@dataclass
class Received:
    tokens: int = 0  # in complete events, counted by their logprobs entries
    done: bool = False  # saw `data: [DONE]`
    error: dict | None = None
    request_id: str | None = None


class SlowClient:
    """Sends a streamed completion and reads only when told to."""

    def __init__(self, url: str, key: str, body: dict):
        u = urlsplit(url)
        self.sock = socket.socket()
        # Small, so that what the server writes ahead fills it soon; set before connecting
        # (the window it advertises is fixed then).
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
        self.sock.connect((u.hostname, u.port))
        self.conn = h11.Connection(h11.CLIENT)
        payload = json.dumps({**body, "stream": True}).encode()
        headers = [("Host", u.netloc), ("Authorization", f"Bearer {key}"),
                   ("Content-Type", "application/json"),
                   ("Content-Length", str(len(payload)))]  # fmt: skip
        request = h11.Request(method="POST", target="/v1/completions", headers=headers)
        self.sock.sendall(
            self.conn.send(request) + self.conn.send(h11.Data(data=payload))
            + self.conn.send(h11.EndOfMessage())
        )  # fmt: skip
        self.got, self.buf = Received(), b""

    def read_to_end(self, timeout: float = 60) -> Received:
        """Read until the server ends the response or closes the connection."""
        self.sock.settimeout(timeout)
        try:
            while True:
                try:
                    event = self.conn.next_event()
                except h11.RemoteProtocolError:  # closed mid-response: an unfinished stream
                    return self.got
                if event is h11.NEED_DATA:
                    self.conn.receive_data(self.sock.recv(65536))
                elif isinstance(event, h11.Response):
                    assert event.status_code == 200
                elif isinstance(event, h11.Data):
                    self._parse(event.data)
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    return self.got
        finally:
            self.sock.close()

    def _parse(self, data: bytes) -> None:
        self.buf += data
        while b"\n\n" in self.buf:
            raw, self.buf = self.buf.split(b"\n\n", 1)
            payload = raw.removeprefix(b"data: ")
            if payload == b"[DONE]":
                self.got.done = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                self.got.error = chunk["error"]
                continue
            self.got.request_id = chunk["id"]
            for choice in chunk["choices"]:
                self.got.tokens += len((choice.get("logprobs") or {}).get("tokens", []))


@pytest.fixture
def long_stream(server):
    """Starts a long stream that nobody reads yet; its socket is closed after the test (a
    stalled connection left open would hold the server's shutdown)."""
    clients: list[SlowClient] = []

    def start(key: str) -> SlowClient:
        body = {"model": server.state.model_name, "prompt": "The quick brown",
                "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "logprobs": 0}  # fmt: skip
        clients.append(SlowClient(server.url, key, body))
        return clients[-1]

    yield start
    for client in clients:
        client.sock.close()


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return value


def _usage(srv, request_id: str) -> UsageRecord | None:
    with srv.sessions() as session:
        return session.scalars(
            select(UsageRecord).where(UsageRecord.request_id == request_id)
        ).one_or_none()


def _stalled(srv):
    """(the stream's job, engine stats) once the engine has paused the only stream."""
    engine = srv.state.engine

    def settled():
        # The first pauses may resume while the socket buffers still take bytes: wait until
        # the paused stream holds still for half a second.
        s = engine.stats()
        if s.paused != 1:
            return None
        time.sleep(0.5)
        t = engine.stats()
        same = (t.paused, t.steps, t.generated_tokens) == (1, s.steps, s.generated_tokens)
        return t if same else None

    stats = _wait_for(settled, 30, "never paused for good")
    (job,) = srv.state.streams.values()
    return job, stats


def _engine_holds_none(srv) -> bool:
    """The engine has let go of every request (its stats arrive a step after an abort)."""
    s = srv.state.engine.stats()
    return s.paused == s.running == 0


def test_open_streams_hold_no_database_connection(server, long_stream):
    """A stream keeps no pooled connection while it runs, so many long streams cannot exhaust
    the pool (15 connections by default) and fail everyone else's requests. The streams are
    unread, so they stay open (paused in the engine) while the pool is looked at, however fast
    the engine is: in a server with the default buffers a fast engine finishes such streams
    first, and their usage writes were what the pool showed."""
    _, key = server.new_tenant("streamer")
    pool = server.state.sessions.kw["bind"].pool
    # an earlier test's stream may still be ending (its usage write): start from none
    idle = lambda: not server.state.streams and not server.state.inflight  # noqa: E731
    _wait_for(idle, STALL_TIMEOUT_S + 10, "an earlier stream did not end")
    clients = [long_stream(key) for _ in range(8)]
    # every stream has started: its auth and quota charge (the DB work a request does before
    # its first byte) are behind it
    _wait_for(lambda: len(server.state.streams) == 8, 30, "the streams did not start")
    # Other requests' short DB work may hold one for a moment; streams hold none, so some
    # moment while all eight are open finds at most one out.
    seen = []  # (connections out, streams open)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not any(c <= 1 and n == 8 for c, n in seen):
        seen.append((pool.checkedout(), len(server.state.streams)))
        time.sleep(0.01)
    assert any(c <= 1 and n == 8 for c, n in seen), seen
    for client in clients:  # hung up: the server ends them, and the next test starts clean
        client.sock.close()
    _wait_for(idle, STALL_TIMEOUT_S + 10, "the hung-up streams did not end")
    _wait_for(lambda: _engine_holds_none(server), 10, "the engine still holds them")


def test_a_stalled_stream_pauses_in_the_engine_and_resumes_when_read(server, long_stream):
    _, key = server.new_tenant("reader")
    generated_before = server.state.engine.stats().generated_tokens
    client = long_stream(key)
    job, stats = _stalled(server)
    written = job.sent_tokens
    generated = stats.generated_tokens - generated_before
    # The engine ran ahead of what the connection accepted by the window, not by the answer.
    assert written < 120, written
    assert generated - written <= WINDOW + PAUSE_LAG, (generated, written)
    time.sleep(0.5)
    after = server.state.engine.stats()
    assert (after.steps, after.generated_tokens) == (stats.steps, stats.generated_tokens)
    assert after.running == 0 and after.paused == 1  # its batch slot is free

    got = client.read_to_end()  # reading again resumes it, to the end
    assert got.done and got.error is None
    assert got.tokens == MAX_TOKENS
    row = _wait_for(lambda: _usage(server, got.request_id), 10, "no usage record")
    assert row.status == "ok" and row.completion_tokens == MAX_TOKENS


def test_a_client_stalled_past_the_timeout_is_cut_and_billed_what_was_written(server, long_stream):
    _, key = server.new_tenant("sleeper")
    generated_before = server.state.engine.stats().generated_tokens
    client = long_stream(key)
    job, _ = _stalled(server)
    request_id = job.request_id
    row = _wait_for(lambda: _usage(server, request_id), STALL_TIMEOUT_S + 10, "not ended")
    assert row.status == "aborted"
    # aborted in the engine, KV freed: the abort reaches the engine process after the usage
    # write may have happened, so wait for it there
    _wait_for(lambda: _engine_holds_none(server), 10, "the engine still holds it")
    stats = server.state.engine.stats()
    generated = stats.generated_tokens - generated_before
    assert generated - row.completion_tokens <= WINDOW + PAUSE_LAG

    # What the server wrote before giving up is still delivered, then the connection closes
    # without [DONE]: the client reads exactly the tokens it was billed.
    got = client.read_to_end(timeout=10)
    assert not got.done
    assert got.tokens == row.completion_tokens > 0
