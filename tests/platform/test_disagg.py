"""Disaggregated serving across processes: `loraplex serve --role prefill` and `--role
decode` as two real worker processes on one host sharing a disk KV tier, and the front
(platform/disagg.py) streaming each request through them, with the server's colocated engine
beside it as the fallback and the reference.

Checked: outputs identical to the colocated engine (mixed adapters, n > 1 seeded, a stop
string, prompt logprobs), the decode worker loaded the prompts' blocks from the tier, a
stream the client drops frees the decode worker's blocks, and a decode worker killed
mid-stream ends that stream with EngineDeadError while the next request falls back to the
colocated engine and succeeds. The workers export their spans to an OTLP/HTTP receiver here,
and a traced request through the front server is one trace across the front and both workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from sqlalchemy import select

from loraplex.engine import AsyncLLMEngine, LLMEngine, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import EngineDeadError
from loraplex.platform.db.models import UsageRecord
from loraplex.platform.disagg import DisaggregatedEngine
from testkit.server import free_port, wait_ready
from tests.utils.server import run_server, upload_adapter

ENGINE = dict(max_model_len=512, max_lora_rank=16, dtype="float32")  # block size 16: default
LORAPLEX = str(Path(sys.executable).with_name("loraplex"))


class _Collector(BaseHTTPRequestHandler):
    """An OpenTelemetry collector's OTLP/HTTP trace endpoint: it keeps the spans it gets."""

    def do_POST(self):  # noqa: N802 - http.server's name
        message = ExportTraceServiceRequest()
        message.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        for rs in message.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                self.server.spans += [(service["service.name"], s) for s in ss.spans]
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def collector():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    server.spans = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _worker(role: str, model: Path, tier: Path, data: Path,
            traces: str) -> tuple[subprocess.Popen, str]:  # fmt: skip
    port = free_port()
    env = {**os.environ, "LORAPLEX_DATA_DIR": str(data / role), "LORAPLEX_NUM_THREADS": "1",
           "LORAPLEX_KV_TIER_DISK_PATH": str(tier), "LORAPLEX_DEVICE": "cpu",
           "LORAPLEX_OTLP_TRACES_ENDPOINT": traces, "OTEL_BSP_SCHEDULE_DELAY": "50",
           **{f"LORAPLEX_{k.upper()}": str(v) for k, v in ENGINE.items()}}  # fmt: skip
    proc = subprocess.Popen(
        [
            LORAPLEX,
            "serve",
            "--role",
            role,
            "--model",
            str(model),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(data / f"{role}.log").open("wb"),
    )  # fmt: skip  (a file, not a pipe: a full pipe would stall the worker)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fleet(tiny_models, tmp_path_factory, collector):
    """(front, colocated engine, decode worker process, decode URL)."""
    model = tiny_models["llama"]
    root = tmp_path_factory.mktemp("disagg")
    traces = f"http://127.0.0.1:{collector.server_address[1]}"
    prefill, purl = _worker("prefill", model, root / "tier", root, traces)
    decode, durl = _worker("decode", model, root / "tier", root, traces)
    try:
        for proc, url in ((prefill, purl), (decode, durl)):

            def alive(proc=proc):
                if proc.poll() is not None:
                    raise RuntimeError(
                        proc.stderr.name + ": " + Path(proc.stderr.name).read_text()[-2000:]
                    )

            wait_ready(f"{url}/healthz", 120, "a worker", check=alive)
        torch.set_num_threads(1)
        local = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(model), **ENGINE)))
        yield DisaggregatedEngine(local, purl, durl), local, decode, durl
        local.shutdown()
    finally:
        for proc in (prefill, decode):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (prefill, decode):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def loras(tiny_adapters):
    named = tiny_adapters["llama"]
    return [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(named.items())]


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _last(engine, prompt, params, lora, rid):
    text, last = "", None
    async for out in engine.generate(prompt, params, lora, request_id=rid):
        text += out.delta_text
        last = out
    return last, text


def test_front_streams_through_both_workers_identically(fleet, loras):
    front, local, _, durl = fleet
    cases = [
        (_prompt(1, 30), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        (
            _prompt(2, 17),
            SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=8, ignore_eos=True),
        ),  # fmt: skip
        (
            _prompt(3, 41),
            SamplingParams(
                temperature=0, max_tokens=10, prompt_logprobs=1, logprobs=2, ignore_eos=True
            ),
        ),  # fmt: skip
        (_prompt(4, 25), SamplingParams(temperature=0, max_tokens=1)),  # ends at prefill
    ]

    async def run():
        results = []
        for i, (prompt, params) in enumerate(cases):
            lora = loras[i % len(loras)]
            want = await _last(local, prompt, params, lora, f"want-{i}")
            got = await _last(front, prompt, params, lora, f"got-{i}")
            results.append((want, got))
        await front.close()
        return results

    for (want, wtext), (got, gtext) in asyncio.run(run()):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in want.outputs]
        assert gtext == wtext
        if want.prompt_logprobs is not None:
            assert got.prompt_logprobs.ranks == want.prompt_logprobs.ranks
    assert front.counts["disaggregated"] == 3 and front.counts["ended_at_prefill"] == 1
    status = httpx.get(f"{durl}/disagg/status").json()
    assert status["role"] == "decode" and status["requests"] == 0
    assert status["tokens_loaded"] >= 16 * (30 // 16 + 17 // 16 + 41 // 16)  # every full block


def test_a_dropped_stream_frees_the_decode_worker(fleet, loras):
    front, _, decode, durl = fleet
    params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    before = httpx.get(f"{durl}/disagg/status").json()["tokens_generated"]

    async def drop():
        stream = front.generate(_prompt(9, 30), params, loras[1], request_id="drop")
        async for _ in stream:
            decode.send_signal(signal.SIGSTOP)  # held mid-stream while the client goes away
            break
        await stream.aclose()
        await front.close()
        decode.send_signal(signal.SIGCONT)

    asyncio.run(drop())
    deadline = time.monotonic() + 30
    while True:
        s = httpx.get(f"{durl}/disagg/status").json()
        if s["requests"] == 0 and s["free_blocks"] == s["num_blocks"]:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.1)
    assert s["tokens_generated"] - before < 400  # aborted, not run to its end (479 more)


def _sse_text(resp: httpx.Response) -> tuple[str, dict | None]:
    text, usage = "", None
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            text += "".join(c.get("text", "") for c in event.get("choices", []))
            usage = event.get("usage") or usage
    return text, usage


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def test_the_server_streams_one_request_through_the_workers(
    fleet, tiny_models, tiny_adapters, tmp_path, collector, monkeypatch
):
    """The OpenAI route on a front server, with an adapter: one stream, one usage record, the
    colocated engine's text, and one trace: the caller's, continued by the front's request
    span, whose children are the prefill and the decode worker's spans."""
    _, _, _, durl = fleet
    purl = fleet[0].prefill[0].url
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: the front's batch goes out at once
    traces = f"http://127.0.0.1:{collector.server_address[1]}"
    with run_server(tiny_models["llama"], tmp_path, disagg_prefill_urls=purl,
                    disagg_decode_urls=durl, engine_process=False, otlp_traces_endpoint=traces,
                    max_model_len=512, max_lora_rank=16) as srv:  # fmt: skip
        tenant, key = srv.new_tenant("disagg")
        auth = {"Authorization": f"Bearer {key}"}
        qv4 = tiny_adapters["llama"]["qv4"]
        assert upload_adapter(srv.url, key, "qv", qv4).status_code == 201
        body = {"model": "qv", "prompt": "The quick brown fox jumps over the lazy dog. " * 4,
                "max_tokens": 12, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        front = srv.state.engine
        assert isinstance(front, DisaggregatedEngine)
        traced = {**auth, "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}
        got = httpx.post(f"{srv.url}/v1/completions", json=body, headers=traced, timeout=120)
        assert got.status_code == 200, got.text
        assert front.counts["disaggregated"] == 1
        ours = _trace_spans(collector, {"POST /v1/completions", "disagg.prefill", "disagg.decode"})
        srv.state.engine = front.local  # the same request, colocated
        want = httpx.post(f"{srv.url}/v1/completions", json=body, headers=auth, timeout=120)
        srv.state.engine = front
        (gtext, gusage), (wtext, wusage) = _sse_text(got), _sse_text(want)
        assert gtext == wtext and gtext
        assert gusage["completion_tokens"] == wusage["completion_tokens"]
        assert gusage["prompt_tokens"] == wusage["prompt_tokens"]
        with srv.sessions() as session:
            records = session.scalars(
                select(UsageRecord).where(UsageRecord.tenant_id == tenant)
            ).all()
        assert len(records) == 2  # one per request, the disaggregated one included
        assert {r.completion_tokens for r in records} == {gusage["completion_tokens"]}
    (root,) = [s for service, s in ours if service == "loraplex" and s.name.startswith("POST")]
    assert root.parent_span_id.hex() == CALLER_SPAN
    (prefill,) = [s for service, s in ours if service == "loraplex-prefill"]
    (decode,) = [s for service, s in ours if service == "loraplex-decode"]
    assert (prefill.name, decode.name) == ("disagg.prefill", "disagg.decode")
    assert prefill.parent_span_id == root.span_id and decode.parent_span_id == root.span_id
    pa, da = _attributes(prefill), _attributes(decode)
    assert pa["loraplex.adapter"] == da["loraplex.adapter"] and pa["loraplex.adapter.id"] > 0
    assert pa["gen_ai.usage.input_tokens"] == da["gen_ai.usage.input_tokens"]
    assert pa["gen_ai.usage.input_tokens"] == gusage["prompt_tokens"]
    assert pa["loraplex.status"] == "handoff" and da["loraplex.status"] == "finished"
    assert da["gen_ai.usage.output_tokens"] == gusage["completion_tokens"]
    blocks = gusage["prompt_tokens"] // 16
    assert blocks >= 2 and pa["loraplex.kv.blocks_stored"] == blocks
    assert da["loraplex.kv.blocks_loaded"] == blocks  # the decode worker computed none of them
    assert prefill.start_time_unix_nano < decode.start_time_unix_nano < root.end_time_unix_nano


def _trace_spans(collector, names: set[str]) -> list[tuple[str, object]]:
    """(service, span) of TRACE_ID's spans, once every one of `names` has come in."""
    deadline = time.monotonic() + 30
    while True:
        ours = [(service, s) for service, s in collector.spans if s.trace_id.hex() == TRACE_ID]
        if names <= {s.name for _, s in ours}:
            return ours
        assert time.monotonic() < deadline, [(service, s.name) for service, s in ours]
        time.sleep(0.05)


def _attributes(span) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def test_decode_worker_death_ends_the_stream_then_falls_back(fleet, loras):
    front, _, decode, _ = fleet
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run():
        got = 0
        with pytest.raises(EngineDeadError):
            async for _ in front.generate(_prompt(7, 20), params, loras[2], request_id="dies"):
                got += 1
                if got == 1:
                    decode.send_signal(signal.SIGSTOP)  # mid-stream: nothing more is sent
                    decode.kill()
        assert got >= 1
        # The decode pool is down now: the next request runs colocated, whole.
        out, _ = await _last(front, _prompt(8, 20), SamplingParams(temperature=0, max_tokens=5),
                             loras[2], "after")  # fmt: skip
        await front.close()
        return out

    colocated = front.counts["colocated"]
    out = asyncio.run(run())
    assert out.finished and len(out.outputs[0].token_ids) == 5
    assert front.counts["colocated"] == colocated + 1
