"""Disaggregated serving across processes: `loraplex serve --role prefill` and `--role
decode` as two real worker processes on one host sharing a disk KV tier, and the front
(platform/disagg.py) streaming each request through them, with the server's colocated engine
beside it as the fallback and the reference.

Checked: outputs identical to the colocated engine (mixed adapters, n > 1 seeded, a stop
string, prompt logprobs), the decode worker loaded the prompts' blocks from the tier, a
stream the client drops frees the decode worker's blocks, and a decode worker killed
mid-stream ends that stream with EngineDeadError while the next request falls back to the
colocated engine and succeeds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from sqlalchemy import select

from loraplex.engine import AsyncLLMEngine, LLMEngine, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import EngineDeadError
from loraplex.platform.db.models import UsageRecord
from loraplex.platform.disagg import DisaggregatedEngine
from testkit.server import free_port, wait_ready
from tests.utils.server import run_server

ENGINE = dict(max_model_len=512, max_lora_rank=16, dtype="float32")  # block size 16: default
LORAPLEX = str(Path(sys.executable).with_name("loraplex"))


def _worker(role: str, model: Path, tier: Path, data: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "LORAPLEX_DATA_DIR": str(data / role), "LORAPLEX_NUM_THREADS": "1",
           "LORAPLEX_KV_TIER_DISK_PATH": str(tier), "LORAPLEX_DEVICE": "cpu",
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
def fleet(tiny_models, tmp_path_factory):
    """(front, colocated engine, decode worker process, decode URL)."""
    model = tiny_models["llama"]
    root = tmp_path_factory.mktemp("disagg")
    prefill, purl = _worker("prefill", model, root / "tier", root)
    decode, durl = _worker("decode", model, root / "tier", root)
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


def test_the_server_streams_one_request_through_the_workers(fleet, tiny_models, tmp_path):
    """The OpenAI route on a front server: one stream, one usage record, the colocated
    engine's text."""
    _, _, _, durl = fleet
    purl = fleet[0].prefill[0].url
    with run_server(tiny_models["llama"], tmp_path, disagg_prefill_urls=purl,
                    disagg_decode_urls=durl, engine_process=False,
                    max_model_len=512, max_lora_rank=16) as srv:  # fmt: skip
        tenant, key = srv.new_tenant("disagg")
        body = {"model": srv.state.model_name, "prompt": "The quick brown fox jumps over the",
                "max_tokens": 12, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        auth = {"Authorization": f"Bearer {key}"}
        front = srv.state.engine
        assert isinstance(front, DisaggregatedEngine)
        got = httpx.post(f"{srv.url}/v1/completions", json=body, headers=auth, timeout=120)
        assert got.status_code == 200, got.text
        assert front.counts["disaggregated"] == 1
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
