"""Non-streamed answers are billed by whether they can still reach the client's connection.

A whole answer is generated before any byte of it is sent, and its client may leave in
between; billing it when generation ends would bill tokens nobody received. So the route
leaves its jobs here (`bill_on_send`), and this ASGI middleware bills them when the answer's
body is about to be handed to the connection: as sent if the connection is still open then
(the look sse.py takes: one loop turn, so that a close already seen is handled, then whether
uvicorn saw the connection close), else as aborted with no completion tokens; the body goes
out right after, with the usage record already written (a client that reads the ledger once
its answer came finds it there). An answer that never got out (an error after generation)
bills them as errors with none.
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
        status = 0

        async def settle(delivered: bool) -> None:
            jobs, pending[:] = list(pending), []
            for service, job in jobs:
                if delivered:
                    await service.finish(job, "ok")
                else:
                    job.sent_tokens = 0
                    await service.finish(job, "aborted" if status == 200 else "error")

        async def metered(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if pending and last:
                await asyncio.sleep(0)  # a connection_lost already queued runs first
                await settle(status == 200 and not connection_closed_now(receive))
            await send(message)

        try:
            await self.app(scope, receive, metered)
        finally:
            await settle(False)
