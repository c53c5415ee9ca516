"""The engine in its own process: same streams as in-process, typed errors, death reported."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import statistics
import time

import pytest

from loraplex.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from loraplex.engine.adapters.lora import AdapterError
from loraplex.engine.adapters.manager import AdapterUnavailable
from loraplex.engine.process.async_engine import EngineDeadError
from loraplex.engine.process.engine_process import EngineProcess
from tests.engine.streams import read_then_hang_up


@pytest.fixture(scope="module")
def pengine(tiny_models):
    engine = EngineProcess(EngineConfig(str(tiny_models["llama"]), dtype="float32", seed=3))
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params, lora=None, rid=None):
    outs = []
    async for out in engine.generate(prompt, params, lora, request_id=rid, tenant="t1"):
        outs.append(out)
    return outs


def _offline(model: str, prompts, params, loras):
    engine = LLMEngine(EngineConfig(model, dtype="float32", seed=3))
    for i, (p, lo) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{i}", p, params, lo)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_streams_match_the_engine_in_process(pengine, tiny_models, tiny_adapters):
    adapters = tiny_adapters["llama"]
    loras = [
        None,
        LoRARequest("qv4", 1, str(adapters["qv4"])),
        LoRARequest("attn8", 2, str(adapters["attn8"])),
        None,
    ]
    prompts = ["The quick brown fox", "Once upon a time", [5, 17, 99, 3], "Numbers"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    async def main():
        return await asyncio.gather(
            *(_collect(pengine, p, params, lo) for p, lo in zip(prompts, loras, strict=True))
        )

    results = asyncio.run(main())
    expected = _offline(str(tiny_models["llama"]), prompts, params, loras)
    for outs, want in zip(results, expected, strict=True):
        last = outs[-1]
        assert last.finished and not any(o.finished for o in outs[:-1])
        got, ref = last.outputs[0], want.outputs[0]
        assert got.token_ids == ref.token_ids and got.text == ref.text
        assert "".join(o.delta_text for o in outs) == got.text  # the deltas add up
        assert [t for o in outs for t in o.delta_token_ids] == got.token_ids
        assert last.prompt_token_ids == want.prompt_token_ids
        assert got.finish_reason == "length" and last.lora_name == want.lora_name
        # logprobs keep their int token ids across the JSON pipe (values: float noise of
        # another process's batch shapes)
        assert [list(d) for d in got.logprobs] == [list(d) for d in ref.logprobs]
        for d, r in zip(got.logprobs, ref.logprobs, strict=True):
            assert all(
                isinstance(k, int) and v == pytest.approx(r[k], abs=1e-4) for k, v in d.items()
            )
    assert pengine.config.max_model_len > 0 and pengine.tokenizer is not None
    assert pengine.weight_bytes > 0


def test_step_messages_stay_flat_over_a_long_output(pengine):
    params = SamplingParams(temperature=0, max_tokens=220, ignore_eos=True, logprobs=2)
    pengine.step_bytes.clear()
    outs = asyncio.run(_collect(pengine, "Once", params))
    assert len(outs[-1].outputs[0].token_ids) == 220 and len(outs[-1].outputs[0].logprobs) == 220
    # Per step: a message may cover several fast steps (COALESCE_S); its bytes spread over them.
    sizes = [size / steps for size, steps in pengine.step_bytes for _ in range(steps)]
    assert len(sizes) == 220  # every step's new token went out once
    # Medians: now and then a message also carries the engine's stats snapshot (more often
    # per step on a loaded machine, whose steps are slower). Bytes that grew with the output
    # would be many times the early ones by step 200; a tenth covers the snapshots.
    early, late = statistics.median(sizes[5:15]), statistics.median(sizes[195:205])
    assert late <= early * 1.1 + 16, (sizes[5:15], sizes[195:205])


def test_errors_come_back_typed_to_their_request_only(pengine, tmp_path):
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    (bad_dir / "adapter_config.json").write_text("{not json")
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        return await asyncio.gather(
            _collect(pengine, "hello", greedy, LoRARequest("bad", 9, str(bad_dir))),
            _collect(pengine, "hello", greedy, LoRARequest("gone", 10, str(tmp_path / "nope"))),
            _collect(pengine, [10**9], greedy),  # token id outside the vocabulary
            _collect(pengine, "hello", greedy),
            return_exceptions=True,
        )

    bad, gone, oov, good = asyncio.run(main())
    assert isinstance(bad, AdapterError) and "JSON" in str(bad)
    assert isinstance(gone, (AdapterError, AdapterUnavailable)), gone
    assert isinstance(oov, ValueError), oov
    assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 4


def test_a_cancelled_stream_is_aborted_in_the_child(pengine):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    assert read_then_hang_up(pengine, "a long story", params, 3) == 3
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        s = pengine.stats()
        if s.running == 0 and s.waiting == 0 and s.kv_usage == 0:
            break
        time.sleep(0.05)
    s = pengine.stats()
    assert s.alive and s.running == 0 and s.waiting == 0 and s.kv_usage == 0, s


def test_engine_death_fails_waiting_callers(tiny_models):
    engine = EngineProcess(EngineConfig(str(tiny_models["llama"]), dtype="float32"))
    params = SamplingParams(
        temperature=0, max_tokens=engine.config.max_model_len - 8, ignore_eos=True
    )

    async def main():
        got = 0
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("x", params):
                got += 1
                if got == 2:
                    os.kill(engine._proc.pid, signal.SIGKILL)
        return got

    try:
        assert asyncio.run(main()) >= 2  # outputs already sent may still arrive
        assert not engine.stats().alive
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(engine, "again", params))
    finally:
        engine.shutdown(timeout=2)


def test_a_model_that_cannot_load_raises_at_start(tiny_models, tmp_path):
    src = tiny_models["llama"]
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(src / name, tmp_path / name)  # the weights are missing
    with pytest.raises(RuntimeError, match="could not start"):
        EngineProcess(EngineConfig(str(tmp_path), dtype="float32"))
