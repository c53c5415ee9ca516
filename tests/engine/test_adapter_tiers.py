"""Adapter tiers: loads start when a request is queued and run beside the engine's steps;
adapters in use are never evicted; a failed load fails only its adapter's requests.

The "slow store" is the adapter reader patched to block on an event the test controls, so
"the steps went on during the load" is a fact of ordering, not a timing threshold.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.adapters import manager as am
from loraplex.engine.adapters.manager import AdapterUnavailable
from loraplex.engine.process.async_engine import AsyncLLMEngine
from testkit.factories import make_adapter

PROMPT = [1, 17, 42, 99, 250, 7]
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_models) -> str:
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def paths(tiny_models, tmp_path_factory) -> dict[int, Path]:
    """Six adapters by lora_int_id."""
    root = tmp_path_factory.mktemp("tiers")
    return {
        i: make_adapter(tiny_models["llama"], root / f"a{i}", r=4, seed=40 + i) for i in range(1, 7)
    }


def lora(paths: dict[int, Path], i: int, name: str | None = None) -> LoRARequest:
    return LoRARequest(name or f"a{i}", i, str(paths[i]))


@pytest.fixture(scope="module")
def reference(llama, paths) -> dict[tuple[int, int], list[int]]:
    """(adapter id or 0, max_tokens) -> greedy tokens, each run alone."""
    llm = LLM(llama, dtype="float32", max_lora_rank=8)
    ref = {}
    for i in (0, *paths):
        for params in (SHORT, LONG):
            out = llm.generate([PROMPT], params, lora(paths, i) if i else None)
            ref[(i, params.max_tokens)] = out[0].outputs[0].token_ids
    return ref


def drain(engine, limit: int = 500) -> dict:
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine did not finish")


def slow_reader(monkeypatch, slow_name: str):
    """Patch the adapter reader: loads of `slow_name` block until the returned gate opens."""
    gate, started = threading.Event(), threading.Event()
    real = am.load_adapter

    def read(path, *args, name=None, **kwargs):
        if name == slow_name:
            started.set()
            assert gate.wait(60), "the test never let the slow load finish"
        return real(path, *args, name=name, **kwargs)

    monkeypatch.setattr(am, "load_adapter", read)
    return gate, started


def test_cold_adapter_load_does_not_pause_other_requests(llama, paths, reference, monkeypatch):
    gate, started = slow_reader(monkeypatch, "cold")
    engine = LLM(llama, dtype="float32", max_lora_rank=8).engine
    engine.add_request("base", PROMPT, LONG)
    engine.add_request("warm", PROMPT, LONG, lora(paths, 1))
    engine.step()  # both prefilled, one token each
    engine.add_request("cold", PROMPT, SHORT, lora(paths, 2, "cold"), wait_for_adapter=False)
    assert started.wait(30), "the load starts when the request is queued, before any step"
    tokens = {"base": 1, "warm": 1}
    step_seconds = []
    for _ in range(20):
        t0 = time.perf_counter()
        outs = engine.step()
        step_seconds.append(time.perf_counter() - t0)
        for out in outs:
            tokens[out.request_id] += len(out.delta_token_ids)
    # 20 steps went by while the load was still held: each gave both running requests a
    # token, and none of them waited for the load.
    assert not gate.is_set() and not engine.adapters.loaded(2)
    assert tokens == {"base": 21, "warm": 21}, f"step seconds: {step_seconds}"
    gate.set()
    done = drain(engine)
    assert done["cold"].outputs[0].token_ids == reference[(2, SHORT.max_tokens)]
    assert done["base"].outputs[0].token_ids == reference[(0, LONG.max_tokens)]
    assert done["warm"].outputs[0].token_ids == reference[(1, LONG.max_tokens)]
    c = engine.adapters.counters
    assert (c.misses, c.loads) == (2, 2) and c.load_seconds > 0
    engine.add_request("again", PROMPT, SHORT, lora(paths, 2, "cold"))
    assert engine.adapters.counters.hits == 1, "a second request finds it in host memory"
    drain(engine)


def test_eviction_never_touches_an_adapter_in_use(llama, paths, reference):
    llm = LLM(llama, dtype="float32", max_lora_rank=8, max_loras=2, max_cpu_loras=2)
    engine = llm.engine
    engine.add_request("long", PROMPT, LONG, lora(paths, 1))
    engine.step()
    slot = engine.adapters.slots.index(1)
    done = {}
    for i in range(2, 7):  # five more adapters cycle through the one other slot
        engine.add_request(f"short{i}", PROMPT, SHORT, lora(paths, i))
        while f"short{i}" not in done:
            for out in engine.step():
                done[out.request_id] = out
            assert engine.adapters.slots[slot] == 1, "the running request's slot was reused"
            assert engine.adapters.loaded(1), "the running request's adapter left host memory"
            assert len(engine.adapters.host) <= 3  # max_cpu_loras + the one pinned by a request
    done |= drain(engine)
    assert engine.adapters.counters.slot_writes == 6
    assert done["long"].outputs[0].token_ids == reference[(1, LONG.max_tokens)]
    for i in range(2, 7):
        assert done[f"short{i}"].outputs[0].token_ids == reference[(i, SHORT.max_tokens)]


def _broken_store(monkeypatch, name: str) -> None:
    real = am.load_adapter

    def read(path, *args, name=None, **kwargs):
        if name == broken:
            raise ConnectionResetError("the store closed the connection")
        return real(path, *args, name=name, **kwargs)

    broken = name
    monkeypatch.setattr(am, "load_adapter", read)


def test_store_failure_fails_only_that_adapters_requests(llama, paths, reference, monkeypatch):
    _broken_store(monkeypatch, "broken")
    engine = LLM(llama, dtype="float32", max_lora_rank=8).engine
    engine.add_request("base", PROMPT, SHORT)
    engine.add_request("good", PROMPT, SHORT, lora(paths, 1))
    for rid in ("bad1", "bad2"):
        engine.add_request(rid, PROMPT, SHORT, lora(paths, 3, "broken"), wait_for_adapter=False)
    done = drain(engine)
    for rid in ("bad1", "bad2"):
        out = done[rid]
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
        assert "adapter 'broken' cannot be served" in out.error
        assert "the store closed the connection" in out.error
        assert isinstance(engine.load_errors[rid], AdapterUnavailable)
    assert done["base"].outputs[0].token_ids == reference[(0, SHORT.max_tokens)]
    assert done["good"].outputs[0].token_ids == reference[(1, SHORT.max_tokens)]
    assert engine.adapters.refs == {} and engine.adapters.counters.load_failures == 1
    engine.block_manager.check_all_free()
    # A failure is not remembered: once the store is back, the adapter serves.
    monkeypatch.undo()
    engine.add_request("retry", PROMPT, SHORT, lora(paths, 3, "broken"), wait_for_adapter=False)
    assert drain(engine)["retry"].outputs[0].token_ids == reference[(3, SHORT.max_tokens)]


def test_server_engine_raises_a_clear_error_for_that_caller_only(
    llama, paths, reference, monkeypatch
):
    _broken_store(monkeypatch, "broken")
    aengine = AsyncLLMEngine(LLM(llama, dtype="float32", max_lora_rank=8).engine)

    async def collect(lora_request):
        last = None
        async for out in aengine.generate(PROMPT, SHORT, lora_request, tenant="t"):
            last = out
        return last.outputs[0].token_ids

    async def main():
        return await asyncio.gather(
            collect(lora(paths, 3, "broken")),
            collect(lora(paths, 1)),
            collect(None),
            return_exceptions=True,
        )

    try:
        bad, good, base = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert isinstance(bad, AdapterUnavailable)
    assert "'broken' could not be read: the store closed the connection" in str(bad)
    assert good == reference[(1, SHORT.max_tokens)]
    assert base == reference[(0, SHORT.max_tokens)]


def test_adapter_slots_and_kv_pool_share_one_budget(llama):
    budget = 2 << 20
    reports = {}
    for max_loras in (1, 8):
        llm = LLM(
            llama, dtype="float32", max_loras=max_loras, max_lora_rank=8, kv_cache_bytes=budget
        )
        report = llm.engine.memory
        assert report.adapter_slot_bytes + report.kv_cache_bytes <= budget
        assert report.kv_cache_bytes == llm.engine.runner.kv_cache_bytes
        reports[max_loras] = report
    assert reports[8].adapter_slot_bytes > reports[1].adapter_slot_bytes
    assert reports[8].num_kv_blocks < reports[1].num_kv_blocks, "slots come out of the KV share"
    with pytest.raises(ValueError, match="adapter slots need"):
        LLM(llama, dtype="float32", max_loras=8, max_lora_rank=64, kv_cache_bytes=1 << 20)
