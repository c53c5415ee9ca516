"""The server through a database outage (a TCP proxy the test cuts between it and PostgreSQL),
a kill during one, an engine that stops reading under a burst, the adapter store gone and the
upload scratch space unusable: every request billed as its client received it, request by
request; never a 500; readiness that follows the database; health routes that answer while
the engine is stopped; errors that name what failed."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shutil
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
from sqlalchemy import make_url, select

from loraplex.platform.db import crud
from loraplex.platform.db.models import UsageRecord
from loraplex.platform.db.session import make_engine, make_sessionmaker, upgrade
from loraplex.platform.state import JOURNAL_FILE
from loraplex.platform.store import adapter_digest
from loraplex.platform.uploads.scratch import scratch_unavailable
from tests.platform.conftest import _empty_pg_schema, _pg_admin_connect
from tests.platform.test_quickstart import Serve
from tests.utils.server import ADMIN_KEY, run_server
from tests.utils.sse_client import stream_completion
from tests.utils.tcp_proxy import tcp_proxy
from tests.utils.uploads import complete, folder_parts, upload

OUTAGE_S = 10  # the shortest outage the issue names
READY_WITHIN_S = 5  # /readyz false after the database goes, true after it returns


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Traffic:
    """What the clients saw: per request id, the tokens received; and every other answer."""

    received: dict[str, int] = field(default_factory=dict)
    refused: list[tuple[int, str | None, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, response: httpx.Response) -> None:
        with self.lock:
            if response.status_code == 200:
                body = response.json()
                self.received[body["id"]] = len(body["choices"][0]["logprobs"]["tokens"])
            else:
                code = response.json()["error"]["code"]
                self.refused.append(
                    (response.status_code, code, response.headers.get("retry-after"))
                )


def _until(condition: Callable[[], bool], within_s: float, what: str) -> float:
    """Seconds until `condition()` held; fails after `within_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < within_s, f"{what}: not within {within_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def _status(url: str, path: str) -> int:
    try:
        return httpx.get(f"{url}{path}", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _ledger(db_url: str, tenant_id: int) -> dict[str, tuple[str, int]]:
    """request id -> (status, completion tokens) of a tenant, read straight from PostgreSQL."""
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as s:
            rows = s.execute(select(UsageRecord.request_id, UsageRecord.status,
                                    UsageRecord.completion_tokens)
                             .where(UsageRecord.tenant_id == tenant_id))  # fmt: skip
            return {rid: (status, tokens) for rid, status, tokens in rows}
    finally:
        engine.dispose()


def _rows(srv, tenant_id: int) -> list[tuple[str, str, int]]:
    """(request id, status, completion tokens) of a tenant's usage records."""
    with srv.sessions() as session:
        return session.execute(select(UsageRecord.request_id, UsageRecord.status,
                                      UsageRecord.completion_tokens)
                               .where(UsageRecord.tenant_id == tenant_id)).all()  # fmt: skip


def _proxied(db_url: str, port: int) -> str:
    url = make_url(db_url).set(host="127.0.0.1", port=port)
    return url.render_as_string(hide_password=False)


def _pg_port(db_url: str) -> tuple[str, int]:
    url = make_url(db_url)
    return url.host or "127.0.0.1", url.port or 5432


@pytest.fixture(scope="module")
def outage_server(tiny_models, pg_database_url, tmp_path_factory):
    """(proxy, server, database URL): one server for this module's in-process tests, on
    PostgreSQL through a proxy they may cut (and must restore); each test has its tenant."""
    _empty_pg_schema(pg_database_url)
    with (
        tcp_proxy(*_pg_port(pg_database_url)) as proxy,
        run_server(tiny_models["llama"], tmp_path_factory.mktemp("outages"), max_model_len=512,
                   database_url=_proxied(pg_database_url, proxy.port), engine_unresponsive_s=6.0,
                   engine_queued_requests=4) as srv,
    ):  # fmt: skip
        yield proxy, srv, pg_database_url


@pytest.fixture
def own_database(pg_database_url):
    """A PostgreSQL database of the test's own (migrated), dropped after it."""
    name = f"{make_url(pg_database_url).database}_own"
    admin = _pg_admin_connect()
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        url = make_url(pg_database_url).set(database=name)
        url = url.render_as_string(hide_password=False)
        upgrade(url)
        yield url
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


class HeldStreams:
    """Streams that read their first tokens and then stop reading until `release()`: their
    requests are admitted and running (held back by the stream window: the client's receive
    buffer is small) when the database goes, and end while it is away. A thread each."""

    def __init__(self, url: str, key: str, n: int, max_tokens: int = 480):
        self.body = {"model": "llama", "prompt": "Once upon", "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, "logprobs": 5}  # fmt: skip
        self.url, self.key = url, key
        self.go = threading.Event()
        self.started: set[int] = set()
        self.results: list = [None] * n
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(n)]  # fmt: skip
        for t in self.threads:
            t.start()
        _until(lambda: len(self.started) == n, 60, "every held stream running")

    def release(self) -> list:
        self.go.set()
        for t in self.threads:
            t.join(60)
            assert not t.is_alive(), "a held stream did not end"
        return self.results

    def _run(self, i: int) -> None:
        def hold(_tokens: int) -> None:
            self.started.add(i)
            self.go.wait(60)

        self.results[i] = asyncio.run(stream_completion(
            self.url, self.key, self.body, on_tokens=hold, recv_buffer_bytes=4096
        ))  # fmt: skip


def _traffic(url: str, key: str, traffic: Traffic, stop: threading.Event) -> None:
    """Short non-streamed requests, one after the other, until `stop`."""
    body = {"model": "llama", "prompt": "Hello", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}  # fmt: skip
    with httpx.Client(base_url=url, headers=_auth(key), timeout=30) as client:
        while not stop.is_set():
            traffic.answer(client.post("/v1/completions", json=body))
            time.sleep(0.02)


def _check_ledger(ledger: dict[str, tuple[str, int]], traffic: Traffic, streams: list) -> None:
    expected = dict(traffic.received)
    for s in streams:
        assert s.status == 200 and s.finished and s.error is None, s
        expected[s.request_id] = s.tokens
    assert set(ledger) == set(expected), "billed requests differ from those answered"
    wrong = {rid: (ledger[rid], n) for rid, n in expected.items() if ledger[rid] != ("ok", n)}
    assert not wrong, f"billed differently from what the client received: {wrong}"


def test_database_outage_mid_traffic(outage_server, caplog):
    proxy, srv, db_url = outage_server
    caplog.set_level(logging.WARNING)
    tenant, key = srv.new_tenant("outage", tokens_per_min=10**7)
    traffic, stop = Traffic(), threading.Event()
    client = threading.Thread(target=_traffic, args=(srv.url, key, traffic, stop))
    client.start()
    try:
        held = HeldStreams(srv.url, key, n=3)
        _until(lambda: len(traffic.received) >= 3, 30, "traffic before the outage")

        proxy.cut()
        cut_at = time.monotonic()
        try:
            went = _until(lambda: _status(srv.url, "/readyz") == 503, READY_WITHIN_S, "readyz")
            assert _status(srv.url, "/healthz") == 200  # alive: nothing to restart
            admin = httpx.get(f"{srv.url}/admin/api/tenants", headers=_auth(ADMIN_KEY))
            assert admin.status_code == 503
            assert admin.json()["error"]["code"] == "database_unavailable"
            streams = held.release()  # they end while the database is away
            # Billed nowhere yet but in the journal, on this server's disk.
            assert len(srv.state.ledger.journal) >= 3
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - cut_at)))
        finally:
            held.go.set()
            proxy.restore()
        back = _until(lambda: _status(srv.url, "/readyz") == 200, READY_WITHIN_S, "readyz")
        _until(lambda: len(srv.state.ledger.journal) == 0, 10, "the journal written")
        after = len(traffic.received)
        _until(lambda: len(traffic.received) >= after + 3, 30, "traffic after the return")
    finally:
        stop.set()
        client.join(30)

    print(f"readyz false {went:.1f} s after the cut, true {back:.1f} s after the return; "
          f"{len(traffic.received)} answered, {len(traffic.refused)} refused")  # fmt: skip
    assert went < READY_WITHIN_S and back < READY_WITHIN_S
    refused = {(status, code, retry) for status, code, retry in traffic.refused}
    assert refused == {(503, "database_unavailable", "5")}, refused
    _check_ledger(_ledger(db_url, tenant), traffic, streams)
    # One line when the outage began and one when it ended: none per request, beat or poll.
    warned = [r.getMessage() for r in caplog.records
              if r.name.startswith("loraplex") and r.levelno >= logging.WARNING]  # fmt: skip
    assert len(warned) == 2, warned
    assert warned[0].startswith("the database is unreachable")
    assert warned[1].startswith("the database is reachable again")
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_server_killed_during_an_outage_bills_after_its_restart(
    tiny_models, tmp_path, own_database
):
    pg_url = own_database
    engine = make_engine(pg_url)
    with make_sessionmaker(engine)() as session:
        tenant = crud.create_tenant(session, name="acme").id
        key, _ = crud.create_key(session, tenant_id=tenant)
    engine.dispose()

    with tcp_proxy(*_pg_port(pg_url)) as proxy:
        env = {"LORAPLEX_DATABASE_URL": _proxied(pg_url, proxy.port),
               "LORAPLEX_MAX_MODEL_LEN": "512"}  # fmt: skip
        args = ("--model", str(tiny_models["llama"]))
        first = Serve(tmp_path, *args, env=env)
        try:
            first.wait_ready()
            held = HeldStreams(first.url, key, n=3)
            proxy.cut()
            _until(lambda: _status(first.url, "/readyz") == 503, READY_WITHIN_S, "readyz")
            streams = held.release()  # delivered whole, billed nowhere but in the journal
            body = {"model": "llama", "prompt": "hi", "max_tokens": 2}
            refused = httpx.post(f"{first.url}/v1/completions", headers=_auth(key), json=body)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "database_unavailable"
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(30)
        finally:
            first.close()
        with sqlite3.connect(tmp_path / JOURNAL_FILE) as journal:
            kept = {k for (k,) in journal.execute("SELECT key FROM entries")}
        assert kept == {s.request_id for s in streams}
        assert _ledger(pg_url, tenant) == {}

        proxy.restore()
        second = Serve(tmp_path, *args, env=env)
        try:
            second.wait_ready()
            _until(lambda: len(_ledger(pg_url, tenant)) == 3, 10, "the journal written again")
        finally:
            second.close()
    _check_ledger(_ledger(pg_url, tenant), Traffic(), streams)


def test_a_stopped_engine_under_a_burst_freezes_no_route(outage_server, monkeypatch):
    """Requests keep coming while the engine process is stopped: the pipe to it fills (its
    add commands carry the prompts), a few more wait in the queue, the rest are refused."""
    _, srv, _ = outage_server
    # The burst meets the queue's limit alone, however long a loaded machine takes to send it;
    # the unresponsive limit is then lowered for /readyz to report it.
    monkeypatch.setattr(srv.state.settings, "engine_unresponsive_s", 600.0)
    tenant, key = srv.new_tenant("stopped")
    pid = srv.state.engine._proc.pid
    traffic = Traffic()
    body = {"model": "llama", "prompt": [100 + i % 400 for i in range(480)], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "logprobs": 0}  # fmt: skip

    def one() -> None:
        traffic.answer(httpx.post(f"{srv.url}/v1/completions", headers=_auth(key),
                                  json=body, timeout=120))  # fmt: skip

    os.kill(pid, signal.SIGSTOP)
    try:
        burst = []
        for i in range(48):  # more than the pipe and the queue hold
            burst.append(threading.Thread(target=one))
            burst[-1].start()
            time.sleep(0.03)
            if i % 4 == 3:  # every probe and the admin API answer at once meanwhile
                for path in ("/healthz", "/metrics", "/admin/api/tenants"):
                    r = httpx.get(f"{srv.url}{path}", headers=_auth(ADMIN_KEY), timeout=1)
                    assert r.status_code == 200, (path, r.text)
        everyone = lambda: len(traffic.refused) + len(srv.state.inflight) == 48  # noqa: E731
        _until(everyone, 60, "every request admitted or refused")
        monkeypatch.setattr(srv.state.settings, "engine_unresponsive_s", 1.0)
        unresponsive = lambda: httpx.get(f"{srv.url}/readyz", timeout=1).json()["status"]  # noqa: E731
        _until(lambda: unresponsive() == "engine unresponsive", READY_WITHIN_S, "readyz")
    finally:
        os.kill(pid, signal.SIGCONT)
    for t in burst:
        t.join(120)
    _until(lambda: _status(srv.url, "/readyz") == 200, READY_WITHIN_S, "readyz")
    rows = _rows(srv, tenant)

    codes = {(status, code, retry) for status, code, retry in traffic.refused}
    assert codes == {(503, "engine_busy", "2")}, codes  # the queue's limit was reached
    assert traffic.received, "nothing admitted before the limit was served"
    billed = {rid: (status, n) for rid, status, n in rows if status == "ok"}
    assert billed == {rid: ("ok", n) for rid, n in traffic.received.items()}
    # The full queue refuses before the quota is charged: no record. One that filled between
    # that look and its hand-over is billed its prompt and no completion, as any request the
    # engine refused.
    busy = sum(1 for _, code, _ in traffic.refused if code == "engine_busy")
    others = [(s, n) for _, s, n in rows if s != "ok"]
    assert set(others) <= {("error", 0)} and len(others) <= busy, others


def test_a_whole_answer_whose_client_left_is_billed_as_not_received(outage_server):
    """The client leaves while its answer is generated (the engine held so that it is still
    running then); generation then ends before any look at the connection could stop it. The
    answer is never written: billed as aborted, no completion tokens."""
    _, srv, _ = outage_server
    tenant, key = srv.new_tenant("left")
    pid = srv.state.engine._proc.pid
    body = json.dumps({"model": "llama", "prompt": "Hi", "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True}).encode()  # fmt: skip
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
               f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
    os.kill(pid, signal.SIGSTOP)
    try:
        with socket.create_connection(("127.0.0.1", srv.settings.port)) as client:
            client.sendall(request.encode() + body)
            _until(lambda: srv.state.inflight, 10, "the request running")
    finally:
        os.kill(pid, signal.SIGCONT)
    _until(lambda: not srv.state.inflight, 10, "the request billed")
    ((_, status, tokens),) = _rows(srv, tenant)
    assert (status, tokens) == ("aborted", 0)


def test_store_and_scratch_outages_fail_only_what_needs_them(
    outage_server, tiny_adapters, monkeypatch
):
    _, srv, _ = outage_server
    tenant, key = srv.new_tenant("store")
    warm, cold = tiny_adapters["llama"]["qv4"], tiny_adapters["llama"]["attn8"]
    assert upload(srv.url, key, "warm", folder_parts(warm)).status_code == 201
    assert upload(srv.url, key, "cold", folder_parts(cold)).status_code == 201
    shutil.rmtree(srv.state.cache.dir / adapter_digest(cold), ignore_errors=True)
    traffic = Traffic()

    def ask(model: str) -> None:
        traffic.answer(complete(srv.url, key, model, logprobs=0, ignore_eos=True))

    ask("warm")  # now in this server's disk cache
    root = srv.settings.local_store_dir
    away = root.rename(root.with_name(root.name + "-away"))
    try:
        ask("warm")  # cached: served without the store
        ask("llama")
        ask("cold")  # needs the store
        stored = upload(srv.url, key, "later", folder_parts(warm))
    finally:
        away.rename(root)
    assert (stored.status_code, stored.json()["error"]["code"]) == (503, "store_unavailable")
    ask("cold")

    scratch = srv.settings.data_dir / "tmp"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.write_text("")  # no folder can be made there
    try:
        refused = upload(srv.url, key, "later", folder_parts(warm))
    finally:
        scratch.unlink()
    error = refused.json()["error"]
    assert (refused.status_code, error["code"]) == (503, "scratch_unavailable")
    assert "scratch space" in error["message"] and "store" not in error["message"]
    assert upload(srv.url, key, "later", folder_parts(warm)).status_code == 201

    def disk_full(key: str, digest: str):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:  # the adapter cache's disk full: not the store's fault
        m.setattr(srv.state.cache, "get", disk_full)
        uncached = complete(srv.url, key, "cold")
    error = uncached.json()["error"]
    assert (uncached.status_code, error["code"]) == (503, "adapter_unavailable")
    assert "out of disk space" in error["message"] and "store" not in error["message"]
    rows = _rows(srv, tenant)

    assert traffic.refused == [(503, "adapter_unavailable", "5")]
    assert len(traffic.received) == 4
    assert {rid: (s, n) for rid, s, n in rows} == {
        rid: ("ok", n) for rid, n in traffic.received.items()
    }


def test_a_full_scratch_space_is_named_as_such():
    error = scratch_unavailable(1, "a", OSError(errno.ENOSPC, "No space left on device"))
    assert (error.status, error.code) == (503, "scratch_space_full")
    assert "full" in error.message and error.headers["Retry-After"]
