"""Non-streamed answers are billed by what reached the client's connection.

A whole answer is generated before any byte of it is sent, and its client may leave in
between; billing it when generation ends would bill tokens nobody received. So the route
leaves its jobs here (`bill_on_send`), and this ASGI middleware bills them once the answer's
last body message was handed to the connection: as sent if the connection was still open then
(the same look sse.py takes after each event: one loop turn, then whether uvicorn saw it
close), else as aborted with no completion tokens. An answer that never got out (an error
after generation) bills them as errors with none.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.openai.sse import connection_closed_now

_PENDING = "loraplex.bill_on_send"  # the scope's list of (service, job) to bill on send


def bill_on_send(request, service, job) -> bool:
    """Leave `job` (its `sent_tokens` set to what the answer carries) to be billed when the
    answer is sent; False for a request that is no HTTP connection (a batch line): bill it now."""
    pending = getattr(request, "scope", {}).get(_PENDING)
    if pending is None:
        return False
    pending.append((service, job))
    return True


class BillOnSend:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        pending: list = []
        scope[_PENDING] = pending
        status, delivered = 0, False

        async def metered(message: Message) -> None:
            nonlocal status, delivered
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if pending and last:
                await asyncio.sleep(0)  # a connection_lost already queued runs first
                delivered = not connection_closed_now(receive)

        try:
            await self.app(scope, receive, metered)
        finally:
            for service, job in pending:
                if status == 200 and delivered:
                    await service.finish(job, "ok")
                else:
                    job.sent_tokens = 0
                    await service.finish(job, "aborted" if status == 200 else "error")
