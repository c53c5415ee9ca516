"""n and best_of: the samples share the prompt's KV (forked after prefill, no recompute), each
draws from its own seed stream, best_of returns the n most likely; nothing leaks."""

from __future__ import annotations

import dataclasses

import pytest

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.llm_engine import _sample_seed

SAMPLED = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=12, ignore_eos=True)


def prompt(offset: int, length: int = 37) -> list[int]:
    # 37 tokens: two full blocks of 16 and a partly filled third, which a fork must copy.
    return [1] + [(offset * 31 + 5 * i) % 500 + 2 for i in range(length - 1)]


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(str(tiny_models["llama"]), dtype="float32", max_lora_rank=8)


@pytest.fixture(scope="module")
def lora(tiny_adapters) -> LoRARequest:
    name, path = next(iter(tiny_adapters["llama"].items()))
    return LoRARequest(name, 1, str(path))


def alone(llm, p, params, lora=None, index=0):
    """What sample `index` must be: the same prompt as a request of its own with its seed."""
    single = dataclasses.replace(params, n=1, best_of=None, seed=_sample_seed(params.seed, index))
    return llm.generate([p], single, lora)[0].outputs[0]


@pytest.mark.parametrize("with_adapter", [False, True])
def test_each_sample_is_the_request_alone_with_its_own_seed(llm, lora, with_adapter):
    adapter = lora if with_adapter else None
    p = prompt(1 + with_adapter)
    (out,) = llm.generate([p], dataclasses.replace(SAMPLED, n=4), adapter)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    for c in out.outputs:
        assert c.token_ids == alone(llm, p, SAMPLED, adapter, c.index).token_ids
        assert c.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # own streams, not one repeated
    llm.engine.block_manager.check_all_free()
    assert not llm.engine.adapters.refs


def test_the_prompt_is_computed_once(llm):
    engine = llm.engine
    costs = []
    for i, n in enumerate((1, 4)):
        before = engine.num_prompt_tokens_computed
        llm.generate([prompt(10 + i)], dataclasses.replace(SAMPLED, n=n))
        costs.append(engine.num_prompt_tokens_computed - before)
    assert costs == [37, 37]  # the bound is 1.3x; forking copies the partial block


def test_best_of_returns_the_n_most_likely_samples(llm):
    p = prompt(20)
    params = dataclasses.replace(SAMPLED, n=2, best_of=4)
    (out,) = llm.generate([p], params)
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None for c in out.outputs)  # not asked for
    scored = dataclasses.replace(SAMPLED, logprobs=0)
    singles = [alone(llm, p, scored, index=i) for i in range(4)]
    best = sorted(singles, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    for got, want in zip(out.outputs, best, strict=True):
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)


def test_samples_survive_kv_pressure_and_preemption(tiny_models):
    # 12 blocks of 16 for 3 requests x 3 samples of 37 + 24 tokens: preemption must happen.
    llm = LLM(str(tiny_models["llama"]), dtype="float32", num_kv_blocks=12, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [prompt(30 + i) for i in range(3)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    outs = llm.generate(prompts, dataclasses.replace(greedy, n=3))
    assert llm.engine.scheduler.num_preemptions > 0
    for out, w in zip(outs, want, strict=True):
        assert [c.token_ids for c in out.outputs] == [w] * 3
    llm.engine.block_manager.check_all_free()


def test_abort_ends_every_sample_and_frees_everything(llm, lora):
    engine = llm.engine
    engine.add_request("ab", prompt(40), dataclasses.replace(SAMPLED, n=3, max_tokens=50), lora)
    engine.step()
    engine.step()
    out = engine.abort("ab")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished() and "ab" not in engine.requests
    engine.block_manager.check_all_free()
    assert not engine.adapters.refs


def test_streamed_texts_only_grow(llm):
    engine = llm.engine
    engine.add_request("st", prompt(50), dataclasses.replace(SAMPLED, n=3, stop=["zzz"]))
    seen: dict[int, str] = {}
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                assert c.text.startswith(seen.get(c.index, ""))
                seen[c.index] = c.text
            final = out
    assert final.finished and len(final.outputs) == 3


def test_too_many_samples_for_the_engine_are_refused(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_num_seqs=2)
    with pytest.raises(ValueError, match="exceeds the engine's max_num_seqs"):
        llm.engine.add_request("x", prompt(1), dataclasses.replace(SAMPLED, n=3))
    assert not llm.engine.has_unfinished()
