"""Request tracing: a trace per inference request with its phases, the caller's `traceparent`
continued, exported over OTLP/HTTP; nothing of the SDK loaded when tracing is off."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from loraplex.platform import tracing
from loraplex.platform.db.session import upgrade
from loraplex.platform.main import create_app
from loraplex.platform.settings import Settings
from tests.utils.server import ADMIN_KEY, run_server, upload_adapter

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
LIST_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
LIST_PARENT = f"00-{LIST_TRACE_ID}-b7ad6b7169203331-01"
SERVER_PHASES = {"auth", "quota", "prefill", "decode"}


def _memory_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


# ------------------------------------------------------------------ the spans, from engine times
def test_engine_times_become_spans_with_their_own_times():
    """The engine's part (queue, adapter load, prefill, decode) is built from the times its
    outputs carry, under the request's span and the caller's trace."""
    provider, exporter = _memory_provider()
    t0 = time.time()

    class Metrics:  # vLLM's RequestMetrics names, as the engine would send them
        arrival_time = t0 + 0.010
        first_scheduled_time = t0 + 0.050
        first_token_time = t0 + 0.080
        finished_time = t0 + 0.200
        num_preemptions = 2
        adapter_tier = "host"
        adapter_load_time = 0.015

    class Out:
        metrics = Metrics()

    times = tracing.engine_times(Out())
    assert times.queue_ms == pytest.approx(40.0, abs=0.01)

    async def app(scope, receive, send):  # a route that ran one engine request
        now = time.monotonic()
        tracing.end_auth()
        tracing.record_job(tracing.JobTrace(
            submitted=now, first_token=now + 0.5, ended=now + 1.0, adapter="pirate",
            adapter_digest="ab" * 32, adapter_tier="disk", prompt_tokens=7,
            completion_tokens=5, finish_reason="length", status="ok", engine=times,
            tenant_id=3, model="pirate", request_id="cmpl-1"))  # fmt: skip
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    client = TestClient(tracing.TracingMiddleware(app, provider=provider))
    assert client.post("/v1/completions", headers={"traceparent": TRACEPARENT}).status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans.pop("POST /v1/completions")
    assert set(spans) == {"auth", "queue", "adapter_load", "prefill", "decode", "response"}
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_ID and root.parent.is_remote
    assert all(s.parent.span_id == root.context.span_id for s in spans.values())

    def ns(seconds: float) -> int:
        return int(seconds * 1e9)

    q, load, pre, dec = spans["queue"], spans["adapter_load"], spans["prefill"], spans["decode"]
    assert (q.start_time, q.end_time) == (
        ns(Metrics.arrival_time),
        ns(Metrics.first_scheduled_time),
    )
    # A slot write from host memory: in the request's first scheduled step.
    assert (load.start_time, load.end_time - load.start_time) == (q.end_time, ns(0.015))
    assert load.attributes["loraplex.adapter.tier"] == "host"  # the engine's word wins
    assert load.attributes["loraplex.adapter.load_ms"] == pytest.approx(15.0)
    assert (pre.start_time, pre.end_time) == (q.end_time, ns(Metrics.first_token_time))
    assert (dec.start_time, dec.end_time) == (pre.end_time, ns(Metrics.finished_time))
    assert "loraplex.timing" not in pre.attributes
    a = root.attributes
    assert (a["loraplex.tenant.id"], a["loraplex.adapter"], a["loraplex.preemptions"]) == (
        3, "pirate", 2)  # fmt: skip
    assert a["loraplex.adapter.digest"] == "sha256:" + "ab" * 32
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (7, 5)
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["http.response.status_code"] == 200


def test_other_paths_and_bad_traceparents():
    provider, exporter = _memory_provider()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    client = TestClient(tracing.TracingMiddleware(app, provider=provider))
    client.get("/healthz")
    assert exporter.get_finished_spans() == ()  # only inference requests are traced
    client.post("/v1/chat/completions", headers={"traceparent": "00-nonsense-01"})
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("POST")]
    assert span.parent is None  # a new trace, not an error
    assert span.attributes["http.response.status_code"] == 404


def test_traces_url():
    assert tracing.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert tracing.traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError, match="not an http"):
        tracing.traces_url("c:4318")
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        Settings(otlp_traces_endpoint="grpc://c:4317")


def test_tracing_off_loads_no_sdk(tmp_path, tiny_models):
    """Off (the default), the app imports neither the SDK nor an exporter and adds no middleware
    (the OpenTelemetry API itself comes with FastAPI, which imports it)."""
    code = (
        "import sys\n"
        "from loraplex.platform.db.session import upgrade\n"
        "from loraplex.platform.main import create_app\n"
        "from loraplex.platform.settings import Settings\n"
        f"s = Settings(data_dir={str(tmp_path)!r}, model={str(tiny_models['llama'])!r})\n"
        "upgrade(s.database_url)\n"
        "app = create_app(s, load_model=False)\n"
        "assert not app.user_middleware or all('Tracing' not in str(m) "
        "for m in app.user_middleware), app.user_middleware\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter', 'opentelemetry.proto'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ a served request, in memory
def test_served_request_in_memory(tiny_models, tiny_adapters, tmp_path):
    settings = Settings(data_dir=tmp_path, model=str(tiny_models["llama"]), admin_key=ADMIN_KEY,
                        dtype="float32", max_model_len=256, engine_process=False)  # fmt: skip
    upgrade(settings.database_url)
    app = create_app(settings)
    provider, exporter = _memory_provider()
    app.add_middleware(tracing.TracingMiddleware, provider=provider)
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.1)
        state = app.state.lp
        from loraplex.platform.db import crud

        with state.sessions() as session:
            tenant = crud.create_tenant(session, name="acme")
            tenant_id = tenant.id
            key, _ = crud.create_key(session, tenant_id=tenant_id)
        files = [
            ("files", (p.name, p.read_bytes())) for p in tiny_adapters["llama"]["qv4"].iterdir()
        ]
        auth = {"Authorization": f"Bearer {key}"}
        r = client.post("/v1/adapters", headers=auth, data={"name": "qv"}, files=files)
        assert r.status_code == 201, r.text
        body = {"model": "qv", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "stream": True, "ignore_eos": True}  # fmt: skip
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers=auth | {"traceparent": TRACEPARENT}) as r:  # fmt: skip
            assert r.status_code == 200
            assert "[DONE]" in "".join(r.iter_text())
        r = client.post("/v1/completions", headers=auth,
                        json={"model": "qv", "prompt": "x", "max_tokens": 999})  # fmt: skip
        assert r.status_code == 400
        listed = client.post("/v1/completions", headers=auth | {"traceparent": LIST_PARENT},
                             json={"model": "qv", "prompt": ["a", "b c"], "max_tokens": 2,
                                   "ignore_eos": True})  # fmt: skip
        assert listed.status_code == 200
    spans = exporter.get_finished_spans()
    ours = [s for s in spans if format(s.context.trace_id, "032x") == TRACE_ID]
    names = {s.name for s in ours}
    assert names >= SERVER_PHASES | {"POST /v1/chat/completions", "adapter_fetch", "stream"}
    root = next(s for s in ours if s.name == "POST /v1/chat/completions")
    assert root.attributes["loraplex.tenant.id"] == tenant_id
    assert root.attributes["loraplex.adapter"] == "qv"
    assert root.attributes["loraplex.adapter.tier"] in ("device", "host", "disk")
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    by_name = {s.name: s for s in ours}
    # The engine's own word on the adapter: read from disk for this first request.
    load = by_name["adapter_load"].attributes
    assert load["loraplex.adapter.tier"] == "disk" and load["loraplex.adapter.load_ms"] > 0
    assert root.attributes["loraplex.adapter.tier"] == "disk"
    # In order: auth, then quota, then the engine's part; the stream ends last.
    assert by_name["auth"].end_time <= by_name["quota"].start_time
    assert by_name["quota"].end_time <= by_name["prefill"].start_time
    assert by_name["prefill"].end_time <= by_name["decode"].end_time <= by_name["stream"].end_time
    assert by_name["stream"].end_time <= root.end_time
    # A prompt list: one set of engine spans per prompt, the request span has the totals.
    listed = [s for s in spans if format(s.context.trace_id, "032x") == LIST_TRACE_ID]
    list_root = next(s for s in listed if s.name == "POST /v1/completions")
    ids = sorted(s.attributes["loraplex.request_id"] for s in listed if s.name == "decode")
    assert len(ids) == 2 and ids[0].endswith("-0") and ids[1].endswith("-1")
    assert list_root.attributes["gen_ai.usage.output_tokens"] == 4
    assert tuple(list_root.attributes["gen_ai.response.finish_reasons"]) == ("length", "length")
    # The refused request has its own trace: its span says 400, and no engine phases.
    refused = [
        s
        for s in spans
        if s.context.trace_id not in (root.context.trace_id, list_root.context.trace_id)
    ]
    (bad_root,) = [s for s in refused if s.name == "POST /v1/completions"]
    assert bad_root.attributes["http.response.status_code"] == 400
    assert not {s.name for s in refused} & {"prefill", "decode"}


# ------------------------------------------------------------------ end to end over OTLP/HTTP
class _Receiver(BaseHTTPRequestHandler):
    """The OTLP/HTTP trace endpoint of a collector: protobuf ExportTraceServiceRequests."""

    requests: list[ExportTraceServiceRequest]

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            assert self.headers["Content-Type"] == "application/x-protobuf"
            message = ExportTraceServiceRequest()
            message.ParseFromString(body)
            self.server.received.append(message)  # type: ignore[attr-defined]
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_end_to_end_to_an_otlp_receiver(tiny_models, tiny_adapters, tmp_path, receiver,
                                        monkeypatch):  # fmt: skip
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: the batch goes out at once
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    with run_server(tiny_models["llama"], tmp_path, otlp_traces_endpoint=endpoint) as srv:
        tenant_id, key = srv.new_tenant("acme")
        assert upload_adapter(srv.url, key, "qv", tiny_adapters["llama"]["qv4"]).status_code == 201
        r = httpx.post(f"{srv.url}/v1/completions",
                       json={"model": "qv", "prompt": "The quick", "max_tokens": 3,
                             "ignore_eos": True},
                       headers={"Authorization": f"Bearer {key}", "traceparent": TRACEPARENT},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200
        deadline = time.monotonic() + 10
        while True:
            spans = [(rs.resource, s) for m in receiver.received for rs in m.resource_spans
                     for ss in rs.scope_spans for s in ss.spans]  # fmt: skip
            if any(s.trace_id.hex() == TRACE_ID and s.name.startswith("POST") for _, s in spans):
                break
            assert time.monotonic() < deadline, [s.name for _, s in spans]
            time.sleep(0.05)
    ours = [s for _, s in spans if s.trace_id.hex() == TRACE_ID]
    root = next(s for s in ours if s.name == "POST /v1/completions")
    assert root.parent_span_id.hex() == PARENT_ID
    assert {s.name for s in ours} >= SERVER_PHASES | {"adapter_fetch", "adapter_load", "response"}
    # The adapter's tier and load time came across the engine process's pipe.
    (load,) = [s for s in ours if s.name == "adapter_load"]
    load_attrs = {a.key: a.value for a in load.attributes}
    assert load_attrs["loraplex.adapter.tier"].string_value == "disk"
    assert load_attrs["loraplex.adapter.load_ms"].double_value > 0
    assert all(s.parent_span_id == root.span_id for s in ours if s is not root)
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["loraplex.tenant.id"].int_value == tenant_id
    assert attrs["gen_ai.usage.output_tokens"].int_value == 3
    service = {a.key: a.value.string_value for a in spans[0][0].attributes}
    assert service["service.name"] == "loraplex"
