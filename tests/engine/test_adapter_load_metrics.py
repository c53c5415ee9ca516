"""Per request, where its adapter was when it arrived (device slot, host memory, disk) and how
long it waited for it (`RequestOutput.metrics`), across the engine process's pipe; per tier a
histogram and per adapter the cold loads, in the engine's stats snapshot."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.process.output_deltas import OutputDecoder, OutputEncoder, StepMessage
from loraplex.engine.snapshot import engine_stats
from loraplex.engine.stats import EngineStats
from testkit.factories import make_adapter

PROMPT = [1, 17, 42, 99, 250, 7]
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("loads")
    paths = [make_adapter(tiny_models["llama"], root / f"a{i}", r=4, seed=i) for i in (1, 2)]
    # One slot: a second adapter pushes the first back to host memory.
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_loras=1, max_lora_rank=8)
    return llm.engine, [LoRARequest(f"7/a{i + 1}", i + 1, str(p)) for i, p in enumerate(paths)]


def run(engine, request_id, lora, wait=True):
    engine.add_request(request_id, PROMPT, PARAMS, lora, wait_for_adapter=wait)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == request_id]
    assert outs[-1].finished
    return outs


def test_tier_and_wait_per_request_and_per_adapter(setup):
    engine, (a1, a2) = setup
    first = run(engine, "disk", a1)
    m = first[-1].metrics
    assert m.adapter_tier == "disk" and m.adapter_load_time > 0
    # Every output of the request says it, the first one too (its first step placed it).
    assert all(o.metrics.adapter_tier == "disk" for o in first)
    assert first[0].metrics.adapter_load_time == m.adapter_load_time

    again = run(engine, "device", a1)[-1].metrics  # still in its slot
    assert (again.adapter_tier, again.adapter_load_time) == ("device", 0.0)

    # Served the way a server does (no wait in add_request): the read ends at a step's poll.
    other = run(engine, "disk2", a2, wait=False)[-1].metrics
    assert other.adapter_tier == "disk" and other.adapter_load_time > 0

    back = run(engine, "host", a1)[-1].metrics  # a2 took the slot; a1 stayed in host memory
    assert back.adapter_tier == "host" and 0 < back.adapter_load_time < m.adapter_load_time

    base = run(engine, "base", None)[-1].metrics
    assert base.adapter_tier is None and base.adapter_load_time is None
    assert not engine._adapter_load and not engine._unplaced and not engine._reading

    s = engine_stats(engine, True)
    assert {t: sum(b) for t, b in s.adapter_load_buckets.items()} == {
        "device": 1, "host": 1, "disk": 2}  # fmt: skip
    assert s.adapter_load_sum["device"] == 0.0
    assert s.adapter_load_sum["host"] == pytest.approx(back.adapter_load_time)
    (top, second) = s.cold_adapters
    assert (top["adapter"], top["loads"], top["from_disk"]) == ("7/a1", 2, 1)
    assert top["seconds"] == pytest.approx(m.adapter_load_time + back.adapter_load_time)
    assert top["max_seconds"] == pytest.approx(m.adapter_load_time)
    assert (second["adapter"], second["loads"], second["from_disk"]) == ("7/a2", 1, 1)
    # The snapshot crosses the engine process's pipe as JSON.
    assert EngineStats(**json.loads(json.dumps(dataclasses.asdict(s)))) == s

    # So do the request's metrics.
    out = dataclasses.replace(first[-1], delta_token_ids=list(first[-1].outputs[0].token_ids))
    raw = StepMessage(outputs=[OutputEncoder().encode(out)]).to_json()
    decoded = OutputDecoder().decode(StepMessage.from_json(raw).outputs[0]).metrics
    assert (decoded.adapter_tier, decoded.adapter_load_time) == ("disk", m.adapter_load_time)


def test_a_failed_load_leaves_nothing_behind(setup, tmp_path):
    engine, _ = setup
    missing = LoRARequest("7/gone", 9, str(tmp_path / "nothing-here"))
    with pytest.raises(Exception):  # noqa: B017 - whichever the reader raises
        engine.add_request("gone", PROMPT, PARAMS, missing)
    assert "gone" not in engine._adapter_load and not engine._reading
    outs = run(engine, "gone2", missing, wait=False)
    assert outs[-1].outputs[0].finish_reason == "error"
    assert outs[-1].metrics.adapter_tier == "disk" and outs[-1].metrics.adapter_load_time is None
    assert not engine._adapter_load and not engine._unplaced and not engine._reading
