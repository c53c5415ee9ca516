"""The server-side engine: concurrent streams, deltas, cancellation, per-request errors."""

from __future__ import annotations

import asyncio
import time

import pytest

from loraplex.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from loraplex.engine.adapters.lora import AdapterError
from loraplex.engine.process.async_engine import AsyncLLMEngine
from tests.engine.streams import read_then_hang_up


@pytest.fixture
def aengine(tiny_models):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(str(tiny_models["llama"]), dtype="float32")))
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params, lora=None):
    deltas, last = [], None
    async for out in engine.generate(prompt, params, lora):
        deltas.append(out.delta_text)
        last = out
    return "".join(deltas), last


def test_concurrent_streams_match_offline(aengine, tiny_models, tiny_adapters):
    adapters = tiny_adapters["llama"]
    loras = [
        None,
        LoRARequest("qv4", 1, str(adapters["qv4"])),
        LoRARequest("attn8", 2, str(adapters["attn8"])),
        None,
    ]
    prompts = ["The quick brown fox", "Once upon a time", "The capital of France", "Numbers"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(
            *(_collect(aengine, p, params, lo) for p, lo in zip(prompts, loras, strict=True))
        )

    results = asyncio.run(main())
    offline = LLMEngine(EngineConfig(str(tiny_models["llama"]), dtype="float32"))
    for i, (text, last) in enumerate(results):
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert text == last.outputs[0].text  # the deltas add up to the whole text
        offline.add_request(f"r{i}", prompts[i], params, loras[i])
    done = {}
    while offline.has_unfinished():
        for out in offline.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for i, (_, last) in enumerate(results):
        assert last.outputs[0].token_ids == done[f"r{i}"]


def test_cancelled_stream_aborts_and_frees_blocks(aengine):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    assert read_then_hang_up(aengine, "a long story", params, 3) == 3
    bm = aengine.engine.block_manager
    deadline = time.monotonic() + 5
    while aengine.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aengine.num_unfinished == 0
    assert bm.num_free_blocks == bm.num_blocks


def test_bad_request_fails_only_itself(aengine, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")

    async def main():
        bad = _collect(
            aengine, "hello", SamplingParams(max_tokens=4), LoRARequest("bad", 9, str(tmp_path))
        )
        good = _collect(
            aengine, "hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(main())
    assert isinstance(bad, AdapterError) and "JSON" in str(bad)
    assert good[1].finished and len(good[1].outputs[0].token_ids) == 4
