"""`EngineStats`: what a router or a scrape reads — residency as it is, readable mid-run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.snapshot import engine_stats
from loraplex.engine.stats import EngineStats
from testkit.factories import make_adapter

PROMPT = [1, 17, 42, 99, 250, 7]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_and_adapters(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("stats")
    paths = [make_adapter(tiny_models["llama"], root / f"a{i}", r=4, seed=i) for i in (1, 2)]
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_loras=1, max_lora_rank=8)
    return llm.engine, [LoRARequest(f"ten-a{i + 1}", i + 1, str(p)) for i, p in enumerate(paths)]


def test_stats_report_residency_not_request_states(engine_and_adapters):
    engine, (a1, a2) = engine_and_adapters
    idle = engine_stats(engine, True)
    assert idle.running == idle.waiting == idle.kv_blocks_used == 0
    assert idle.block_size == engine.config.block_size and idle.adapter_slots == 1

    engine.add_request("r1", PROMPT, PARAMS, a1)
    engine.add_request("r2", PROMPT, PARAMS, a2)
    engine.add_request("r0", PROMPT, PARAMS)  # the base model: no adapter name anywhere
    before = engine_stats(engine, True)
    assert before.waiting == 3 and before.resident_adapters == []
    assert before.waiting_adapters == ["ten-a1", "ten-a2"]
    assert sorted(before.host_adapters) == ["ten-a1", "ten-a2"]  # loaded, not yet in a slot

    engine.step()  # one slot: a1's request runs, a2's waits for the slot
    mid = engine_stats(engine, True)
    assert mid.resident_adapters == ["ten-a1"] and mid.running_adapters == ["ten-a1"]
    assert mid.waiting_adapters == ["ten-a2"] and mid.waiting == 1 and mid.running == 2
    assert 0 < mid.kv_blocks_used <= mid.kv_blocks

    while engine.has_unfinished():
        engine.step()
    after = engine_stats(engine, True)
    assert after.resident_adapters == ["ten-a2"]  # the slot was rewritten for a2
    assert after.running == after.waiting == after.kv_blocks_used == 0
    assert after.waiting_adapters == after.running_adapters == []


def test_stats_cross_the_process_pipe_as_json(engine_and_adapters):
    engine, (a1, _) = engine_and_adapters
    engine.add_request("j1", PROMPT, PARAMS, a1)
    engine.step()
    snap = engine_stats(engine, True)
    back = EngineStats(**json.loads(json.dumps(dataclasses.asdict(snap))))
    assert back == snap
    while engine.has_unfinished():
        engine.step()
