"""`loraplex bench serve` against a real loraplex server, and `benchmarks.replay_engine` in-process.

A few requests, seconds: the report's counts and tokens must agree with what the trace asked
for and with what the server billed. No timing is asserted.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from sqlalchemy import select

from benchmarks.docs import write_docs
from benchmarks.replay_engine import EngineTarget
from loraplex.bench.replay import run_replay
from loraplex.bench.trace import LengthDist, TraceConfig, make_trace
from loraplex.platform.cli import main
from loraplex.platform.db.models import UsageRecord
from tests.utils.server import run_server
from tests.utils.uploads import folder_parts, upload

ADAPTERS = ("qv4", "attn8")


@pytest.fixture(scope="module")
def server(tiny_models, tiny_adapters, tmp_path_factory):
    # A host LRU of 3 for 2 adapters + base: `max_cpu_loras` is a server setting for scaling runs.
    with run_server(
        tiny_models["llama"], tmp_path_factory.mktemp("bench-srv"), max_loras=2, max_cpu_loras=3
    ) as srv:
        tenant_id, key = srv.new_tenant("bench")
        for name in ADAPTERS:
            folder = tiny_adapters["llama"][name]
            assert upload(srv.url, key, name, folder_parts(folder)).status_code == 201
        yield srv, tenant_id, key


def billed(srv, tenant_id: int, expected: int) -> list[UsageRecord]:
    """The tenant's usage rows, once all `expected` have been written (after the stream)."""
    deadline = time.monotonic() + 30
    while True:
        with srv.sessions() as session:
            rows = session.scalars(
                select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)
            ).all()
        if len(rows) >= expected or time.monotonic() > deadline:
            return list(rows)
        time.sleep(0.1)


def test_bench_serve_reports_what_the_server_returned_and_billed(server, tiny_models, tmp_path):
    srv, tenant_id, key = server
    argv = [
        "bench",
        "serve",
        "--url",
        srv.url,
        "--api-key",
        key,
        "--adapter-names",
        ",".join(ADAPTERS),
        "--model-dir",
        str(tiny_models["llama"]),
        "--num-requests",
        "8",
        "--rate",
        "40",
        "--arrival",
        "gamma",
        "--cv",
        "2",
        "--num-adapters",
        "2",
        "--base-fraction",
        "0.25",
        "--input-len",
        "4:12",
        "--output-len",
        "3:6",
        "--seed",
        "3",
        "--slo-ttft-ms",
        "60000",
        "--out",
        str(tmp_path),
        "--tag",
        "smoke",
        "--no-progress",
    ]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "serve-smoke.json").read_text())
    assert (tmp_path / "serve-smoke.png").stat().st_size > 0
    s = doc["summary"]
    trace = make_trace(
        TraceConfig(
            num_requests=8,
            rate=40,
            arrival="gamma",
            cv=2,
            num_adapters=2,
            base_fraction=0.25,
            input_len=LengthDist(4, 12),
            output_len=LengthDist(3, 6),
            vocab_size=512,
            seed=3,
        )
    )
    assert (s["requests"], s["completed"], s["errors"]) == (8, 8, 0)
    # ignore_eos: every request yields exactly the tokens the trace asked for.
    assert [r["output_tokens"] for r in doc["requests"]] == [r.max_tokens for r in trace]
    assert s["output_tokens"] == sum(r.max_tokens for r in trace)
    assert s["prompt_tokens"] == sum(len(r.prompt) for r in trace)
    assert all(r["usage_prompt_tokens"] == r["prompt_tokens"] for r in doc["requests"])
    assert s["slo"]["attainment"] == 1.0
    assert s["ttft"]["p50"] > 0 and s["output_throughput"] > 0
    rows = billed(srv, tenant_id, 8)
    assert len(rows) == 8
    assert sum(r.completion_tokens for r in rows) == s["output_tokens"]
    by_model = Counter(r.adapter_name for r in rows)
    wanted = Counter(None if r.adapter is None else ADAPTERS[r.adapter] for r in trace)
    assert by_model == wanted  # each request went to the adapter the trace chose

    out = write_docs(tmp_path, tmp_path / "benchmarks.md")
    page = out.read_text()
    assert "serve-smoke.json" in page and "8/8 completed" in page


def test_the_host_adapter_cache_size_is_a_server_setting(server):
    srv, _, _ = server
    assert srv.state.engine.config.max_cpu_loras == 3


def test_bench_serve_counts_refused_requests_as_errors(server, tmp_path):
    srv, _, key = server
    argv = [
        "bench",
        "serve",
        "--url",
        srv.url,
        "--api-key",
        key,
        "--adapter-names",
        "no-such",
        "--base-model",
        srv.state.model_name,
        "--vocab-size",
        "512",
        "--num-requests",
        "3",
        "--rate",
        "inf",
        "--num-adapters",
        "1",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--out",
        str(tmp_path),
        "--no-plot",
        "--no-progress",
    ]
    assert main(argv) == 1  # nothing completed
    s = json.loads((tmp_path / "serve.json").read_text())["summary"]
    assert (s["completed"], s["errors"]) == (0, 3)
    assert list(s["error_kinds"]) == ["http 404"]


def test_engine_target_replays_the_same_trace_without_http(tiny_models, tiny_adapters):
    folders = [tiny_adapters["llama"][n] for n in ADAPTERS]
    cfg = TraceConfig(
        num_requests=6,
        rate=float("inf"),
        num_adapters=2,
        input_len=LengthDist(4, 9),
        output_len=LengthDist(2, 5),
        vocab_size=512,
        seed=5,
    )
    trace = make_trace(cfg)
    target = EngineTarget.build(
        tiny_models["llama"], folders, dtype="float32", max_loras=2, max_model_len=64
    )
    results = run_replay(target, trace, progress=False)
    assert all(r.ok for r in results)
    assert [r.output_tokens for r in results] == [r.max_tokens for r in trace]
    assert all(r.ttft is not None and r.ttft <= r.e2e for r in results)
