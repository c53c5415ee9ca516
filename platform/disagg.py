"""The front of disaggregated serving: a request's prefill on a prefill worker, the rest on
a decode worker, one stream to the client (docs/disaggregation.md).

`DisaggregatedEngine` wraps the server's own engine (the colocated one) and is what the
serving layer talks to: `generate` yields the same RequestOutputs an engine would. It sends
the request to a prefill worker (`POST /disagg/prefill`), which answers with the finished
output (the request ended at its first token) or a handoff; the handoff goes to a decode
worker (`POST /disagg/decode`), whose outputs are the stream. The platform's job, usage
record and trace stay one: the workers only compute.

    pick    prefill: the up worker with the fewest requests in flight from here; decode: an
            up worker with the adapter in a slot, then the most free KV blocks (each worker's
            /disagg/status, read at most every STATUS_TTL_S)
    down    a worker that refuses a connection is skipped for DOWN_S
    fallback  no prefill or decode worker up, or one refuses the request before anything was
            streamed: the request runs on the colocated engine, whole; it never fails for it
    death   a decode worker that ends its stream before the last output: the stream ends with
            EngineDeadError (an error event; the platform bills what was sent)
    trace   with tracing on, both calls carry the request span's W3C `traceparent`: the
            workers' spans (`disagg.prefill`, `disagg.decode`) are its children
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import aiohttp

from loraplex.engine import (
    BadRequestError,
    EngineDeadError,
    Handoff,
    LoRARequest,
    RequestOutput,
    SamplingParams,
    output_from_dict,
    request_to_dict,
)
from loraplex.platform import tracing

log = logging.getLogger("loraplex.disagg")
DOWN_S = 5.0
STATUS_TTL_S = 1.0


class _Worker:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.down_until = 0.0
        self.inflight = 0
        self.status: dict = {}
        self.status_at = 0.0

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def failed(self, e: BaseException) -> None:
        log.warning("disaggregation: %s is down for %.0f s: %s", self.url, DOWN_S, e)
        self.down_until = time.monotonic() + DOWN_S


def _urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


class DisaggregatedEngine:
    def __init__(self, local, prefill_urls: str, decode_urls: str, secret: str | None = None,
                 timeout_s: float = 600.0):  # fmt: skip
        self.local = local  # the colocated engine: the fallback
        self.prefill = [_Worker(u) for u in _urls(prefill_urls)]
        self.decode = [_Worker(u) for u in _urls(decode_urls)]
        self.headers = {"X-Disagg-Secret": secret} if secret else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self.counts = {"disaggregated": 0, "colocated": 0, "ended_at_prefill": 0}
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def __getattr__(self, name):  # everything else is the colocated engine's
        return getattr(self.local, name)

    def shutdown(self, *args, **kw):
        """Close the connections to the workers, then stop the colocated engine."""
        for loop, session in list(self._sessions.items()):
            if not loop.is_closed() and not session.closed:
                loop.call_soon_threadsafe(lambda s=session, lp=loop: lp.create_task(s.close()))
        self._sessions.clear()
        return self.local.shutdown(*args, **kw)

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        s = self._sessions.get(loop)
        if s is None or s.closed:
            s = self._sessions[loop] = aiohttp.ClientSession(timeout=self.timeout)
        return s

    async def close(self) -> None:
        """Close this event loop's connections to the workers."""
        s = self._sessions.pop(asyncio.get_running_loop(), None)
        if s is not None:
            await s.close()

    async def _status(self, w: _Worker) -> dict:
        if time.monotonic() - w.status_at > STATUS_TTL_S:
            try:
                async with self._session().get(
                    f"{w.url}/disagg/status", headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as r:  # fmt: skip
                    r.raise_for_status()
                    w.status = await r.json()
            except (TimeoutError, aiohttp.ClientError, OSError):
                w.status = {}  # unknown, not down: the request itself finds out
            w.status_at = time.monotonic()
        return w.status

    async def _pick_decode(self, lora: LoRARequest | None) -> _Worker | None:
        up = [w for w in self.decode if w.up]
        if not up:
            return None
        statuses = await asyncio.gather(*(self._status(w) for w in up))
        ranked = list(zip(up, statuses, strict=True))
        lora_id = lora.lora_int_id if lora is not None else None

        def score(ws):
            w, s = ws
            resident = lora_id is not None and lora_id in s.get("adapters", [])
            return (resident, s.get("free_blocks", 0), -w.inflight)

        return max(ranked, key=score)[0]

    def _headers(self) -> dict[str, str]:
        """The workers' headers: the secret, and the running request's `traceparent` (its
        server span's) when it is traced."""
        parent = tracing.traceparent()
        return self.headers if parent is None else {**self.headers, "traceparent": parent}

    def _pick_prefill(self) -> _Worker | None:
        up = [w for w in self.prefill if w.up]
        return min(up, key=lambda w: w.inflight) if up else None

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
        **kw,
    ) -> AsyncIterator[RequestOutput]:
        params = params or SamplingParams()
        prefill = self._pick_prefill()
        decode = await self._pick_decode(lora_request) if prefill is not None else None
        handoff = None
        if decode is not None:
            ids = self.local.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            rid = request_id or f"disagg-{time.monotonic_ns()}"
            body = request_to_dict(rid, ids, params, lora_request, tenant)
            handoff = await self._prefill(prefill, body)
        if handoff is None:  # no pool, or a worker refused it: colocated, whole
            self.counts["colocated"] += 1
            local = self.local.generate(
                prompt, params, lora_request, request_id=request_id, tenant=tenant, **kw
            )
            async for out in local:
                yield out
            return
        if not isinstance(handoff, Handoff):  # it ended at its first token
            self.counts["ended_at_prefill"] += 1
            yield handoff
            return
        self.counts["disaggregated"] += 1
        async for out in self._decode(decode, handoff, params, lora_request, request_id,
                                      tenant, kw):  # fmt: skip
            yield out

    async def _prefill(self, w: _Worker, body: dict):
        """The worker's handoff or finished output; None if it could not take the request."""
        w.inflight += 1
        try:
            async with self._session().post(f"{w.url}/disagg/prefill", json=body,
                                            headers=self._headers()) as r:  # fmt: skip
                answer = await r.json()
                if r.status == 400:
                    raise BadRequestError(answer.get("error", "the prefill worker refused it"))
                r.raise_for_status()
        except (TimeoutError, aiohttp.ClientError, OSError, json.JSONDecodeError) as e:
            w.failed(e)
            return None
        finally:
            w.inflight -= 1
        if "handoff" in answer:
            return Handoff.from_dict(answer["handoff"])
        return output_from_dict(answer["output"])

    async def _decode(self, w: _Worker, handoff: Handoff, params, lora, request_id, tenant, kw):
        sent = 0
        w.inflight += 1
        try:
            async with self._session().post(f"{w.url}/disagg/decode", json=handoff.to_dict(),
                                            headers=self._headers()) as r:  # fmt: skip
                r.raise_for_status()
                async for line in r.content:
                    item = json.loads(line)
                    if "error" in item:
                        raise BadRequestError(item["error"])
                    out = output_from_dict(item["output"])
                    sent += 1
                    yield out
                    if out.finished:
                        return
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            w.failed(e)
            if sent == 0:  # nothing streamed yet: the colocated engine takes it, whole
                self.counts["colocated"] += 1
                async for out in self.local.generate(handoff.prompt_token_ids, params, lora,
                                                     request_id=request_id, tenant=tenant,
                                                     **kw):  # fmt: skip
                    yield out
                return
            raise EngineDeadError(f"the decode worker ended the stream: {e}") from None
        finally:
            w.inflight -= 1
        raise EngineDeadError("the decode worker ended the stream before its last output")


def disaggregated(local, settings) -> DisaggregatedEngine:
    """The server's engine as the front of the settings' prefill and decode workers."""
    log.info("disaggregation: prefill on %s, decode on %s; colocated fallback here",
             settings.disagg_prefill_urls, settings.disagg_decode_urls)  # fmt: skip
    return DisaggregatedEngine(local, settings.disagg_prefill_urls, settings.disagg_decode_urls,
                               settings.disagg_secret or None)  # fmt: skip
