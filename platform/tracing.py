"""Request tracing with OpenTelemetry: one trace per inference request, exported over OTLP/HTTP.

Off unless `otlp_traces_endpoint` is set (`LORAPLEX_OTLP_TRACES_ENDPOINT`): then, and only
then, the SDK is imported and an ASGI middleware starts a server span for each inference
request, continuing the caller's trace when the request carries a W3C `traceparent`. Off, the
SDK is never imported and each hook (`end_auth`, `phase`, `record_job`) is one
context-variable read that finds None.

The request span's children, each with its own start and end:

    auth          the request's arrival to the route's first service call (body, API key)
    quota         the quota check and token reservation
    adapter_fetch the adapter's files from the adapter store, or the local disk cache
    queue         the engine's wait before it first scheduled the request   (engine timing)
    adapter_load  the request's wait for its adapter, from the tier it was in (engine timing):
                  from the arrival for a read from disk, at the first scheduled step for a
                  slot write from host memory, empty for an adapter already in a slot
    prefill       first computed step to first token
    decode        first token to the last
    stream        the response body: first byte to last

The engine runs in another process and knows nothing of traces: its part is built here from
the times its outputs carry (`RequestOutput.metrics`, vLLM's `RequestMetrics` fields, in
`time.time()` seconds), with explicit start and end times. Where the engine sends no such
times, `prefill` runs from the submission to the first token the server received (so it
includes the queue) and says so with `loraplex.timing = "server"`.
"""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider

# The inference routes a trace is made for.
TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_current: ContextVar[RequestTrace | None] = ContextVar("loraplex_request_trace", default=None)


def current() -> RequestTrace | None:
    """The running request's trace, or None (tracing off, or not an inference request)."""
    return _current.get()


def traceparent() -> str | None:
    """The W3C traceparent of the running request's server span (tracing on), else None: what
    a hop that carries the trace onward (the vLLM data plane, the disaggregation workers) sends."""
    trace = current()
    if trace is None:
        return None
    ctx = trace.span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def end_auth() -> None:
    """The route's first service call: the `auth` span (arrival, body, API key) ends here."""
    trace = _current.get()
    if trace is not None and not trace.auth_done:
        trace.auth_done = True
        trace.child("auth", trace.start_ns, time.time_ns())


def phase(name: str, start: float, end: float, **attributes: Any) -> None:
    """A child span of the current request between two `time.monotonic()` readings; its
    attributes are named `loraplex.<name>.<key>`."""
    trace = _current.get()
    if trace is not None:
        named = {f"loraplex.{name}.{k}": v for k, v in attributes.items()}
        trace.child(name, wall_ns(start), wall_ns(end), **named)


def wall_ns(monotonic: float) -> int:
    """A `time.monotonic()` reading of this process as epoch nanoseconds (spans need those)."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


@dataclass(slots=True)  # made per engine output, traced or not: plain slots, no frozen setattrs
class EngineTimes:
    """One request's times in the engine, epoch nanoseconds; None where the engine sent none."""

    arrival: int | None = None
    first_scheduled: int | None = None
    first_token: int | None = None
    finished: int | None = None
    preemptions: int | None = None
    adapter_tier: str | None = None  # where its adapter was: "device" | "host" | "disk"
    adapter_load_ns: int | None = None

    @property
    def queue_ms(self) -> float | None:
        if self.arrival is None or self.first_scheduled is None:
            return None
        return max(0, self.first_scheduled - self.arrival) / 1e6


def _ns(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)


def engine_times(out: Any) -> EngineTimes | None:
    """The engine's times of a request from its output's `metrics` (vLLM's `RequestMetrics`
    names, `time.time()` seconds), or None when the output carries none. The server calls it
    once per request, when the request ends, on the last output that carried metrics
    (`Job.engine_times`; the ledger's queue time comes from it), tracing or not: kept to plain
    reads."""
    m = getattr(out, "metrics", None)
    if m is None:
        return None
    g = getattr
    preemptions = g(m, "num_preemptions", None)
    return EngineTimes(
        _ns(g(m, "arrival_time", None)),
        _ns(g(m, "first_scheduled_time", None)),
        _ns(g(m, "first_token_time", None)),
        _ns(g(m, "finished_time", None)) or _ns(g(m, "last_token_time", None)),
        None if preemptions is None else int(preemptions),
        g(m, "adapter_tier", None),
        _ns(g(m, "adapter_load_time", None)),
    )


class RequestTrace:
    """One request's server span, the marks of its phases, and the spans made from them."""

    def __init__(self, tracer: Any, span: Any, start_ns: int):
        from opentelemetry import trace

        self.tracer = tracer
        self.span = span
        self.start_ns = start_ns
        self.context = trace.set_span_in_context(span)
        self.auth_done = False
        self.body_start_ns: int | None = None
        self.body_end_ns: int | None = None
        self.streamed = False
        self.jobs = 0  # engine requests reported (a prompt list has several)

    def set(self, **attributes: Any) -> None:
        self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def child(self, name: str, start_ns: int | None, end_ns: int | None, **attributes) -> None:
        """A finished child span, if both its times are known (and in order)."""
        if start_ns is None or end_ns is None:
            return
        span = self.tracer.start_span(name, context=self.context, start_time=start_ns)
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        span.end(end_time=max(start_ns, end_ns))


@dataclass
class JobTrace:
    """What the server saw of one engine request, for its spans (times: monotonic)."""

    submitted: float
    first_token: float | None
    ended: float
    adapter: str | None
    adapter_digest: str | None
    adapter_tier: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    status: str
    engine: EngineTimes | None
    tenant_id: int
    model: str
    request_id: str
    adapter_version: int | None = None  # the registry's version number that answered


def record_job(job: JobTrace) -> None:
    """The job's spans under the request's, and its attributes on the request span."""
    trace = _current.get()
    if trace is None:
        return
    # Which engine request a span is of (a prompt list makes several under one request span;
    # their ids end in the prompt's index).
    index = {"loraplex.request_id": job.request_id}
    trace.jobs += 1
    e = job.engine or EngineTimes()
    submitted = wall_ns(job.submitted)
    first = e.first_token or (wall_ns(job.first_token) if job.first_token else None)
    end = e.finished or wall_ns(job.ended)
    tier = e.adapter_tier or job.adapter_tier
    trace.child("queue", e.arrival, e.first_scheduled, **index)
    if job.adapter is not None and e.adapter_load_ns is not None:
        # A disk read starts when the request arrives; a slot write in its first step.
        at = e.arrival if e.adapter_tier == "disk" else e.first_scheduled or e.arrival
        load_start = at or submitted
        trace.child("adapter_load", load_start, load_start + e.adapter_load_ns,
                    **{"loraplex.adapter.tier": tier,
                       "loraplex.adapter.load_ms": e.adapter_load_ns / 1e6}, **index)  # fmt: skip
    timing = {} if e.first_scheduled else {"loraplex.timing": "server"}
    trace.child("prefill", e.first_scheduled or submitted, first,
                **{"gen_ai.usage.input_tokens": job.prompt_tokens}, **timing, **index)  # fmt: skip
    if first is not None:
        trace.child("decode", first, end,
                    **{"gen_ai.usage.output_tokens": job.completion_tokens}, **index)  # fmt: skip
    if trace.jobs == 1:
        trace.set(**{
            "loraplex.tenant.id": job.tenant_id,
            "loraplex.adapter": job.adapter,
            "loraplex.adapter.version": job.adapter_version and f"v{job.adapter_version}",
            "loraplex.adapter.digest": job.adapter_digest and f"sha256:{job.adapter_digest}",
            "loraplex.adapter.tier": tier,
            "loraplex.status": job.status,
            "loraplex.preemptions": e.preemptions,
            "gen_ai.request.model": job.model,
            "gen_ai.response.id": job.request_id,
            "gen_ai.response.finish_reasons": [job.finish_reason] if job.finish_reason else None,
            "gen_ai.usage.input_tokens": job.prompt_tokens,
            "gen_ai.usage.output_tokens": job.completion_tokens,
        })  # fmt: skip
    else:  # a prompt list: the request's totals
        attrs = trace.span.attributes or {}
        reasons = list(attrs.get("gen_ai.response.finish_reasons", ()))
        trace.set(**{
            "gen_ai.response.finish_reasons": reasons + [job.finish_reason or "none"],
            "gen_ai.usage.input_tokens": attrs.get("gen_ai.usage.input_tokens", 0)
            + job.prompt_tokens,
            "gen_ai.usage.output_tokens": attrs.get("gen_ai.usage.output_tokens", 0)
            + job.completion_tokens,
        })  # fmt: skip


class TracingMiddleware:
    """ASGI middleware: a server span per inference request, in `current()` while it runs."""

    def __init__(self, app: Any, provider: TracerProvider):
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.app = app
        self.tracer = provider.get_tracer("loraplex")
        self.propagator = TraceContextTextMapPropagator()
        self.server_kind = SpanKind.SERVER

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import Status, StatusCode

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = self.propagator.extract(headers)  # a bad traceparent starts a new trace
        start = time.time_ns()
        span = self.tracer.start_span(
            f"{scope['method']} {scope['path']}",
            context=parent,
            kind=self.server_kind,
            start_time=start,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
        )
        trace = RequestTrace(self.tracer, span, start)
        token = _current.set(trace)
        status = 500

        async def traced_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                for k, v in message.get("headers", []):
                    if k.lower() == b"content-type" and v.startswith(b"text/event-stream"):
                        trace.streamed = True
            elif message["type"] == "http.response.body":
                now = time.time_ns()
                if trace.body_start_ns is None:
                    trace.body_start_ns = now
                trace.body_end_ns = now
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as e:
            span.record_exception(e)
            raise
        finally:
            _current.reset(token)
            trace.child("stream" if trace.streamed else "response",
                        trace.body_start_ns, trace.body_end_ns)  # fmt: skip
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of an endpoint: a bare `http://host:4318` gets `/v1/traces`
    (as the OTLP exporters' base endpoint does); a URL with a path is taken as it is."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"otlp_traces_endpoint {endpoint!r} is not an http(s) URL: use e.g. "
            "http://otel-collector:4318 or http://otel-collector:4318/v1/traces"
        )
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def make_provider(endpoint: str, service_name: str = "loraplex") -> TracerProvider:
    """A tracer provider that batches spans to the OTLP/HTTP endpoint (protobuf)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME, when set, names the service (the SDK reads it); else `service_name`.
    named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(named))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    return provider
