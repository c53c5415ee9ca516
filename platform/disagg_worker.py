"""`loraplex serve --role prefill | decode`: an engine that serves one role of disaggregated
serving to a front (platform/disagg.py), not to tenants (docs/disaggregation.md).

    POST /disagg/prefill  a request (JSON) -> {"handoff": ...} once its first tokens are drawn
                          and its prompt blocks stored, or {"output": ...} if it ended there
    POST /disagg/decode   a handoff -> the request's outputs, one JSON object a line, to the
                          end; a client that goes away aborts the request (its blocks freed)
    GET  /disagg/status   role, queue, free KV blocks, adapters in slots (for the front's pick)
    GET  /healthz, /readyz (the chart's probes)

The worker has no tenants, keys or ledger: the front checked and bills the request. It must
be reachable only by the front: with `disagg_secret` set, every call must carry it
(`X-Disagg-Secret`). One thread steps the engine; HTTP handlers hand it commands.

With `otlp_traces_endpoint` set, each prefill and decode call is a span (`disagg.prefill`,
`disagg.decode`) exported as the server exports its own (platform/tracing.py), continuing the
front's `traceparent`: one trace across the front and both workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import queue
import threading
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loraplex.engine import (
    DecodeWorker,
    EngineError,
    Handoff,
    LLMEngine,
    PrefillWorker,
    output_to_dict,
    request_from_dict,
)

log = logging.getLogger("loraplex.disagg")
IDLE_WAIT_S = 0.05  # the thread's wait for a command when nothing runs


class RoleEngine:
    """The engine thread of a role worker: commands in, per-request asyncio queues out."""

    def __init__(self, engine: LLMEngine, role: str):
        assert role in ("prefill", "decode")
        self.role = role
        self.engine = engine
        self.found: dict[str, int] = {}  # decode: prompt tokens found stored, per request
        if role == "prefill":
            self.worker = PrefillWorker(engine)
        else:
            self.worker = DecodeWorker(engine, self.found)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{role}-engine", daemon=True)
        self._thread.start()

    def submit(self, rid: str, payload) -> asyncio.Queue:
        """Queue a request (a prefill's request dict, a decode's Handoff): its items arrive in
        the returned queue, ("output" | "handoff" | "error", value), then None; a decode
        worker's also ("found", the prompt tokens it found stored) before its last output."""
        q: asyncio.Queue = asyncio.Queue()
        self._commands.put(("add", rid, payload, asyncio.get_running_loop(), q))
        return q

    def abort(self, rid: str) -> None:
        self._commands.put(("abort", rid, None, None, None))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.engine.close()

    def status(self) -> dict:
        e = self.engine
        return {
            "role": self.role,
            "requests": len(self._streams),
            "free_blocks": len(e.block_manager.free_queue),
            "num_blocks": e.block_manager.num_blocks,
            "adapters": sorted(i for i in e.adapters.slots if i),  # lora ids in slots
            "tokens_generated": e.num_generated_tokens,  # since start, every request
            # prompt tokens found in the KV tiers instead of computed, since start
            "tokens_loaded": e.kv_tiers.tokens_loaded if e.kv_tiers is not None else 0,
        }

    # ---------------------------------------------------------------- engine thread
    def _send(self, rid: str, item) -> None:
        s = self._streams.get(rid)
        if s is not None:
            s[0].call_soon_threadsafe(s[1].put_nowait, item)

    def _send_found(self, rid: str) -> None:
        if (found := self.found.pop(rid, None)) is not None:
            self._send(rid, ("found", found))

    def _end(self, rid: str) -> None:
        self._send_found(rid)
        self._send(rid, None)
        self._streams.pop(rid, None)

    def _command(self, cmd) -> None:
        kind, rid, payload, loop, q = cmd
        if kind == "abort":
            self.worker.abort(rid)
            self._end(rid)
            return
        self._streams[rid] = (loop, q)
        try:
            if self.role == "prefill":
                _, ids, params, lora, tenant = request_from_dict(payload)
                self.worker.add_request(rid, ids, params, lora, tenant, wait_for_adapter=False)
                return
            first = self.worker.add_handoff(payload, wait_for_adapter=False)
        except (EngineError, ValueError) as e:
            self._send(rid, ("error", str(e)))
            self._end(rid)
            return
        if first is not None:
            self._deliver(first)

    def _deliver(self, item) -> None:
        if isinstance(item, Handoff):
            self._send(item.request_id, ("handoff", item.to_dict()))
            self._end(item.request_id)
            return
        if item.finished:  # before the last output: the front may close the stream on it
            self._send_found(item.request_id)
        self._send(item.request_id, ("output", output_to_dict(item)))
        if item.finished:
            self._end(item.request_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = not self.worker.has_unfinished()
                cmd = self._commands.get(timeout=IDLE_WAIT_S) if wait else None
                while True:
                    if cmd is not None:
                        self._command(cmd)
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
            except queue.Empty:
                continue
            if not self.worker.has_unfinished():
                continue
            try:
                items = self.worker.step()
            except Exception as e:  # noqa: BLE001 (every waiting caller must hear of it)
                log.exception("the %s engine failed", self.role)
                for rid in list(self._streams):
                    self._send(rid, ("error", f"the {self.role} worker failed: {e}"))
                    self._end(rid)
                raise
            for item in items:
                self._deliver(item)


class _Spans:
    """A worker's spans, children of the front's `traceparent`; without a provider, none."""

    def __init__(self, provider: Any | None, block_size: int):
        self.block_size = block_size
        self.tracer = None
        if provider is not None:
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            self.tracer = provider.get_tracer("loraplex")
            self.propagator = TraceContextTextMapPropagator()
            self.kind = SpanKind.SERVER

    def start(self, name: str, request: Request, rid: str, prompt: list, lora: dict | None):
        """The call's span (None when tracing is off); `lora`: the LoRARequest's fields."""
        if self.tracer is None:
            return None
        parent = self.propagator.extract(dict(request.headers))  # none or bad: a new trace
        attrs = {"loraplex.request_id": rid, "gen_ai.usage.input_tokens": len(prompt)}
        if lora:
            attrs |= {"loraplex.adapter": lora["lora_name"],
                      "loraplex.adapter.id": lora["lora_int_id"]}  # fmt: skip
        return self.tracer.start_span(name, context=parent, kind=self.kind, attributes=attrs)

    @staticmethod
    def end(span: Any, status: str, **attrs: Any) -> None:
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attributes({"loraplex.status": status, **attrs})
        if status == "error":
            span.set_status(Status(StatusCode.ERROR))
        span.end()


def create_worker_app(role_engine: RoleEngine, secret: str | None = None,
                      provider: Any | None = None) -> FastAPI:  # fmt: skip
    """The worker's routes; `provider` (an OpenTelemetry TracerProvider): its spans."""
    app = FastAPI(title=f"loraplex {role_engine.role} worker")
    spans = _Spans(provider, role_engine.engine.block_manager.block_size)

    def check(request: Request) -> None:
        if secret and not hmac.compare_digest(request.headers.get("x-disagg-secret", ""), secret):
            raise HTTPException(403, "this worker answers only its front (X-Disagg-Secret)")

    def role(want: str) -> None:
        if role_engine.role != want:
            raise HTTPException(404, f"this is a {role_engine.role} worker, not a {want} one")

    @app.get("/healthz")
    @app.get("/readyz")  # the engine is loaded before the app serves: ready once up
    async def healthz():
        return {"status": "ok", "role": role_engine.role}

    @app.get("/disagg/status")
    async def status(request: Request):
        check(request)
        return role_engine.status()

    @app.post("/disagg/prefill")
    async def prefill(request: Request):
        check(request)
        role("prefill")
        body = await request.json()
        rid = str(body.get("request_id", ""))
        span = spans.start("disagg.prefill", request, rid, body.get("prompt_token_ids") or [],
                           body.get("lora"))  # fmt: skip
        q = role_engine.submit(rid, body)
        try:
            result = None
            while (item := await q.get()) is not None:
                result = item
        except asyncio.CancelledError:
            role_engine.abort(rid)
            spans.end(span, "aborted")
            raise
        kind, value = result
        if kind == "error":
            spans.end(span, "error", **{"loraplex.error": value})
            return JSONResponse({"error": value}, status_code=400)
        if kind == "handoff":  # its first tokens, and the prompt blocks it stored for decode
            stored = {"gen_ai.usage.output_tokens": len(value["samples"]),
                      "loraplex.kv.blocks_stored": value["kv_blocks"]}  # fmt: skip
            spans.end(span, "handoff", **stored)
        else:
            spans.end(span, "finished",
                      **{"gen_ai.usage.output_tokens": value["num_generated_tokens"]})  # fmt: skip
        return {kind: value}

    @app.post("/disagg/decode")
    async def decode(request: Request):
        check(request)
        role("decode")
        handoff = Handoff.from_dict(await request.json())
        rid = handoff.request_id
        lora = dataclasses.asdict(handoff.lora) if handoff.lora is not None else None
        span = spans.start("disagg.decode", request, rid, handoff.prompt_token_ids, lora)
        q = role_engine.submit(rid, handoff)

        async def lines():
            done, status, attrs = False, "aborted", {}
            try:
                while (item := await q.get()) is not None:
                    kind, value = item
                    if kind == "found":  # prompt tokens loaded (the tiers), not computed
                        attrs["loraplex.kv.tokens_loaded"] = value
                        attrs["loraplex.kv.blocks_loaded"] = value // spans.block_size
                        continue
                    if kind == "output":
                        status = "finished" if value["finished"] else status
                        attrs["gen_ai.usage.output_tokens"] = value["num_generated_tokens"]
                    elif kind == "error":
                        status, attrs["loraplex.error"] = "error", value
                    yield json.dumps({kind: value}) + "\n"
                done = True
            finally:
                if not done:  # the front went away: free the request here
                    role_engine.abort(rid)
                spans.end(span, status, **attrs)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


def serve_role(settings, role: str, log_level: str = "info") -> int:
    """Run a prefill or decode worker with the settings' engine options and address."""
    import uvicorn

    from loraplex.platform.main import engine_config, resolve_model_dir

    config = engine_config(settings, resolve_model_dir(settings))
    if not (config.kv_tier_disk_path or config.kv_tier_shared_url or config.kv_tier_host_gib):
        log.warning("%s worker without a KV tier: the decode side computes whole prompts", role)
    role_engine = RoleEngine(LLMEngine(config, progress=True), role)
    provider = None
    if settings.otlp_traces_endpoint:  # the SDK is imported only here, as the server does
        from loraplex.platform import tracing

        provider = tracing.make_provider(settings.otlp_traces_endpoint, f"loraplex-{role}")
    app = create_worker_app(role_engine, settings.disagg_secret or None, provider)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level)
    finally:
        role_engine.stop()
        if provider is not None:
            provider.shutdown()  # the spans still batched go out
    return 0
