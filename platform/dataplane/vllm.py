"""The remote data plane: an unchanged vLLM fleet behind the platform, over vLLM's own HTTP API.

It offers what the platform uses of the embedded engine (engine/process/async_engine.py): `generate`
yielding RequestOutputs with per-token deltas, `abort`, `cut`, `stats`, `config`, `tokenizer`,
`shutdown`. Keys, quotas, the ledger, versions and batches stay in the platform and work
unchanged on top of it.

    platform ── generate(prompt ids, params, LoRARequest) ──▶ VllmDataPlane
                                         │ route: an endpoint that has the adapter loaded
                                         │ agent: adapter version → vLLM (opaque name)
                                         │ FairWindow: ≤ window in flight, VTC order
                                         ▼
        vLLM  POST /v1/completions {prompt: ids, stream, return_token_ids,
                                    continuous_usage_stats, priority}
                                         │ SSE chunks: text + token ids + usage
                                         ▼
                               RequestOutput deltas, as the engine's

A poller thread reads each endpoint's /health, /v1/models (the adapters vLLM has loaded:
routing by residency) and /metrics (running / waiting / KV use, for `stats`). An endpoint
that stops answering takes no new requests; when none answers, `unresponsive_s` says so
(/readyz 503) and new requests get 503 with Retry-After. A stream whose endpoint goes away
ends with an error: the platform bills what was sent, as for any failed stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from loraplex.engine import (
    EngineStats,
    LoRARequest,
    RequestOutput,
    SamplingParams,
    Tokenizer,
    spec_from_config,
)
from loraplex.platform import tracing
from loraplex.platform.dataplane.agent import vllm_name
from loraplex.platform.dataplane.errors import DataPlaneUnavailable
from loraplex.platform.dataplane.fairshare import FairWindow
from loraplex.platform.dataplane.protocol import Assembler, http_error, metrics_of, request_body

log = logging.getLogger("loraplex.dataplane")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
MISSES_TO_DOWN = 3  # polls in a row without an answer in time before an endpoint is down

# (ensure) name, lora request, endpoint -> None; raises AdapterError / AdapterUnavailable
Loader = Callable[["Endpoint", str, LoRARequest], None]


@dataclass
class RemoteConfig:
    """The engine config fields the platform reads, as the fleet reports them."""

    model: str
    max_model_len: int
    max_lora_rank: int


@dataclass
class Endpoint:
    url: str
    window: FairWindow
    healthy: bool = False
    base_id: str | None = None  # vLLM's served model name
    max_model_len: int | None = None
    loaded: set[str] = field(default_factory=set)  # adapter names /v1/models lists
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    ever_seen: bool = False
    misses: int = 0  # polls in a row that got no answer in time

    @property
    def load(self) -> int:
        return self.window.running + self.window.queued


@dataclass
class _Live:
    """One running request: where a `cut` or `abort` from any thread reaches it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    task: asyncio.Task | None = None


class VllmDataPlane:
    """The platform's engine interface over one or more vLLM servers (module doc)."""

    kind = "vllm"

    def __init__(
        self,
        urls: list[str],
        model_dir: str | Path,
        loader: Loader,
        *,
        window: int = 8,
        max_lora_rank: int = 16,
        poll_interval_s: float = 1.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if not urls:
            raise ValueError("the vllm data plane needs at least one vLLM URL (--vllm-url)")
        self.endpoints = [Endpoint(u.rstrip("/"), FairWindow(window)) for u in urls]
        self.model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.spec = spec_from_config(json.loads((self.model_dir / "config.json").read_text()))
        self.loader = loader
        self.agents: dict[str, object] = {}  # endpoint URL -> its adapter agent (closed here)
        self.max_lora_rank = max_lora_rank
        self.poll_interval_s = poll_interval_s
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self.config = RemoteConfig(str(self.model_dir), 0, max_lora_rank)
        self.error: BaseException | None = None  # the platform's "engine died": never here
        self._names: dict[str, str] = {}  # vLLM name -> the platform's adapter name
        self._live: dict[str, _Live] = {}
        self._clients: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._ids = itertools.count()
        self._down_since: float | None = time.monotonic()
        self._generated = 0
        self._stop = threading.Event()
        # One client for the poller's life: a new httpx.Client builds an SSL context (the CA
        # bundle parsed, holding the GIL), which each second stalled the event loop that
        # streams every answer (docs/fleet.md, the hop measured).
        self._http = httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0), verify=False)
        self._poller = threading.Thread(target=self._poll_loop, name="loraplex-vllm-poll",
                                        daemon=True)  # fmt: skip

    # ---------------------------------------------------------------- lifecycle
    def start(self, wait_s: float | None = None) -> None:
        """Poll the endpoints; wait until one answers (None: for ever), so that `config`
        carries the fleet's context length before the platform reads it."""
        self.poll_once()
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while not any(e.ever_seen for e in self.endpoints):
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"no vLLM answered at {[e.url for e in self.endpoints]}")
            time.sleep(self.poll_interval_s)
            self.poll_once()
        self._poller.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join(timeout)
        for agent in self.agents.values():
            if hasattr(agent, "close"):
                agent.close()
        self._http.close()
        for loop, client in self._clients.items():
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing to close
                asyncio.run_coroutine_threadsafe(client.close(), loop)

    # ---------------------------------------------------------------- polling
    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - a poll must never end the poller
                log.exception("polling vLLM failed")

    def poll_once(self) -> None:
        for e in self.endpoints:
            self._poll(self._http, e)
        if any(e.healthy for e in self.endpoints):
            self._down_since = None
        elif self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("no vLLM endpoint answers: new requests get 503")

    def _poll(self, http: httpx.Client, e: Endpoint) -> None:
        try:
            if http.get(f"{e.url}/health").status_code != 200:
                raise httpx.HTTPError("not healthy")
            models = http.get(f"{e.url}/v1/models").json()["data"]
            metrics = http.get(f"{e.url}/metrics").text
        except (httpx.HTTPError, ValueError, KeyError) as err:
            # Refused, or vLLM saying it is unhealthy: down now. A slow answer (a busy host)
            # only after MISSES_TO_DOWN polls in a row: one late poll under load must not
            # send an adapter's requests to a server that does not hold it.
            slow = isinstance(err, httpx.TimeoutException)
            e.misses += 1
            if slow and e.healthy and e.misses < MISSES_TO_DOWN:
                return
            if e.healthy:
                log.warning("vLLM at %s stopped answering: %s", e.url, err)
            e.healthy = False
            return
        e.misses = 0
        base = next((m for m in models if m.get("parent") is None), None)
        was_down = not e.healthy
        e.base_id = base["id"] if base else e.base_id
        e.max_model_len = (base or {}).get("max_model_len") or e.max_model_len
        e.loaded = {m["id"] for m in models if m.get("parent") is not None}
        gauges = metrics_of(metrics, GAUGES)
        e.running = int(gauges["vllm:num_requests_running"])
        e.waiting = int(gauges["vllm:num_requests_waiting"])
        e.kv_usage = gauges["vllm:kv_cache_usage_perc"]
        e.healthy = e.ever_seen = True
        lens = [x.max_model_len for x in self.endpoints if x.max_model_len]
        self.config.max_model_len = min(lens) if lens else self.config.max_model_len
        self.config.model = e.base_id or self.config.model
        if was_down:
            log.info("vLLM at %s answers (%d adapters loaded)", e.url, len(e.loaded))

    # ---------------------------------------------------------------- the engine interface
    def unavailable(self) -> str | None:
        """Why no request can be served now (no endpoint answers), else None: /readyz says
        it, and new requests get 503 with Retry-After meanwhile."""
        if any(e.healthy for e in self.endpoints):
            return None
        since = self._down_since
        for_s = f" for {time.monotonic() - since:.0f} s" if since is not None else ""
        return f"no vLLM endpoint has answered{for_s} ({', '.join(e.url for e in self.endpoints)})"

    def stats(self) -> EngineStats:
        names = [self._names.get(n, n) for e in self.endpoints for n in sorted(e.loaded)]
        return EngineStats(
            running=sum(e.running for e in self.endpoints),
            waiting=sum(e.waiting for e in self.endpoints)
            + sum(e.window.queued for e in self.endpoints),
            generated_tokens=self._generated,
            kv_usage=max((e.kv_usage for e in self.endpoints), default=0.0),
            alive=True,  # vLLM down is not this process dead: readiness says it instead
            resident_adapters=names,
            adapters_in_host=len(names),
        )

    def _route(self, name: str | None) -> Endpoint:
        """An answering endpoint: one that has the adapter loaded, least busy first (as a
        LoRA-aware fleet router does), else the least busy."""
        up = [e for e in self.endpoints if e.healthy]
        if not up:
            raise DataPlaneUnavailable("no vLLM endpoint is answering now; retry shortly")
        if name is not None:
            having = [e for e in up if name in e.loaded]
            if having:
                return min(having, key=lambda e: e.load)
        return min(up, key=lambda e: e.load)

    def _client(self) -> aiohttp.ClientSession:
        """This loop's pooled session (keep-alive connections to every endpoint). aiohttp, not
        httpx, for the streams: its C parser reads a chunk for a fraction of what httpx's
        pure-Python HTTP/1.1 stack and per-read cancel scopes cost, and on a loaded machine
        that time is taken from vLLM (benchmarks/dataplane.py)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            client = self._clients[loop] = aiohttp.ClientSession(
                connector=connector, timeout=self.timeout, json_serialize=json.dumps
            )
        return client

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
        window: int | None = None,
        priority: int = 0,
        headers: dict[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As the engine's: outputs with deltas until one has finished=True. Raises
        BadRequestError (incl. Unsupported), AdapterError, AdapterUnavailable or
        DataPlaneUnavailable."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        name = None
        if lora_request is not None:
            digest = os.path.basename(lora_request.lora_path.rstrip("/"))
            name = vllm_name(lora_request.lora_name, digest)
            self._names[name] = lora_request.lora_name
        endpoint = self._route(name)
        model = name or endpoint.base_id or self.config.model
        body = request_body(model, ids, params, priority)
        if name is not None and name not in endpoint.loaded:
            await asyncio.to_thread(self.loader, endpoint, name, lora_request)
            endpoint.loaded.add(name)
        rid = request_id or f"lpx-{next(self._ids)}"
        max_new = params.max_tokens or max(0, self.config.max_model_len - len(ids))
        cost = (len(ids) + max_new * params.num_samples) / max(weight, 1e-6)
        admission = await endpoint.window.admit(tenant or "", cost, priority=priority)
        # A reader that lags `window` outputs behind stops the reading from vLLM: the stream
        # waits in vLLM's socket (TCP backpressure), not in this process's memory.
        live = _Live(asyncio.get_running_loop(), asyncio.Queue(maxsize=window or 0))
        self._live[rid] = live
        assembler = Assembler(rid, ids, params, lora_request and lora_request.lora_name)
        sent = {"X-Request-Id": rid, **(headers or {})}
        if (parent := tracing.traceparent()) is not None:  # one trace spans the platform and vLLM
            sent["traceparent"] = parent
        live.task = asyncio.create_task(self._read(endpoint, body, sent, assembler, live.queue))
        used = 0
        try:
            while True:
                item = await live.queue.get()
                if isinstance(item, BaseException):
                    raise item
                used = len(ids) + item.num_generated_tokens
                yield item
                if item.finished:
                    return
        finally:
            self._live.pop(rid, None)
            if not live.task.done():
                live.task.cancel()  # closes the HTTP stream: vLLM aborts the request
            self._generated += used - len(ids) if used else 0
            admission.release(used / max(weight, 1e-6))

    async def _read(self, e: Endpoint, body: dict, headers: dict, asm: Assembler,
                    queue: asyncio.Queue) -> None:  # fmt: skip
        try:
            async with self._client().post(
                f"{e.url}/v1/completions", json=body, headers=headers
            ) as r:
                if r.status != 200:
                    raise http_error(r.status, await r.text(), e)
                if not body["stream"]:  # prompt logprobs: one answer at the end
                    out = asm.add(json.loads(await r.read()))
                    if out is not None and out.finished:
                        await queue.put(out)
                        return
                async for line in sse_lines(r.content.iter_any()):
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    out = asm.add(json.loads(data))
                    if out is not None:
                        await queue.put(out)
                        if out.finished:
                            return
            raise DataPlaneUnavailable(f"vLLM at {e.url} ended the stream before it finished")
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError) as err:
            e.healthy = False  # the poller says when it is back
            await queue.put(DataPlaneUnavailable(f"vLLM at {e.url} went away: {err}"))
        except BaseException as err:  # noqa: BLE001 - handed to the reader, who raises it
            await queue.put(err)

    def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None and live.task is not None:
            live.loop.call_soon_threadsafe(live.task.cancel)

    def cut(self, request_id: str, error: BaseException) -> bool:
        """End a request's stream now with `error` (from any thread); False if not here."""
        live = self._live.get(request_id)
        if live is None:
            return False

        def wake() -> None:
            if live.task is not None:
                live.task.cancel()
            while not live.queue.empty():  # raised before any output still queued
                live.queue.get_nowait()
            live.queue.put_nowait(error)

        live.loop.call_soon_threadsafe(wake)
        return True


async def sse_lines(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of a byte stream, however long: aiohttp's own line reading refuses a line
    over twice its buffer (128 KiB), and vLLM's first chunk carries the prompt's token ids
    (`return_token_ids`), a line of about 6 bytes per prompt token."""
    rest = b""
    async for piece in pieces:
        *lines, rest = (rest + piece).split(b"\n")
        for line in lines:
            yield line
    if rest:
        yield rest
