"""A TCP proxy a test controls, between a server and a service it needs (PostgreSQL): `cut()`
drops every connection and refuses new ones, as a database that went away does; `restore()`
listens again on the same port. The service itself is never touched, so a test cannot leave
the machine's PostgreSQL stopped. `delay_s` holds each piece the service sends back for that
long: a stream then reaches the server over seconds, so a cut lands in its middle, not after
a fast service has already handed all of it to the socket buffers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, delay_s: float = 0.0):
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        with socket.socket() as s:  # a free port, kept across cut and restore
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> None:
        self._thread.start()
        self.restore()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def restore(self) -> None:
        async def listen():
            self._server = await asyncio.start_server(
                self._accept, "127.0.0.1", self.port, reuse_address=True
            )

        self._call(listen())

    def cut(self) -> None:
        async def close():
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()
                self._server = None
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()

        self._call(close())

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer, self.delay_s)
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float = 0.0
    ):
        size = 1024 if delay_s else 65536  # small pieces: a delay per piece paces the stream
        try:
            while data := await reader.read(size):
                if delay_s:
                    await asyncio.sleep(delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.transport.abort()


@contextmanager
def tcp_proxy(host: str, port: int, delay_s: float = 0.0) -> Iterator[TcpProxy]:
    proxy = TcpProxy(host, port, delay_s)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.close()
