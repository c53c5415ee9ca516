"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers + peft in float32:
every prompt position, with and without adapters, in one pass and in chunks, beside
prefix-cache hits and after a recompute; n > 1 and max_tokens=0; the same values through the
engine process's delta messages and the thread-mode engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from loraplex.engine import LLM, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from loraplex.engine.outputs import PromptLogprobs, RequestOutput
from loraplex.engine.process.async_engine import AsyncLLMEngine
from loraplex.engine.process.engine_process import EngineProcess
from loraplex.engine.process.output_deltas import OutputDecoder, OutputEncoder, StepMessage
from loraplex.engine.sampling import prompt_logprobs as scoring
from tests.utils.hf_reference import peft_reference, prompt_log_softmax

ADAPTERS = [None, "attn8", "mlp16"]
K = 5
TOL = 1e-4


def _prompts(lengths=(23, 30, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(5, 500, (12,), generator=g).tolist()  # shared: cacheable blocks
    return [prefix + torch.randint(5, 500, (n - 12,), generator=g).tolist() for n in lengths]


def _loras(adapters: dict, names) -> list[LoRARequest | None]:
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    return [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]


def check_against(pl: PromptLogprobs, prompt: list[int], ref: torch.Tensor, k: int) -> float:
    """Assert `pl` is the reference's log-softmax at every position; returns the max |Δ|.
    ref: [len(prompt) - 1, vocab], row i scoring prompt[i + 1]."""
    assert len(pl) == len(prompt), "every position once"
    assert pl.token_logprobs[0] is None and pl.ranks[0] is None and pl.top[0] is None
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)  # [len - 1]
    got = torch.tensor(pl.token_logprobs[1:], dtype=torch.float32)
    delta = float((got - want).abs().max())
    assert delta < TOL, f"prompt logprobs differ from transformers + peft by {delta}"
    for i in range(1, len(prompt)):
        row, w = ref[i - 1], want[i - 1]
        # Rank: 1 + the tokens more likely, up to near-ties within the tolerance.
        lo, hi = int((row > w + TOL).sum()) + 1, int((row > w - TOL).sum()) + 1
        assert lo <= pl.ranks[i] <= hi, f"position {i}: rank {pl.ranks[i]} not in [{lo}, {hi}]"
        top_vals, top_ids = row.topk(k)
        assert len(pl.top[i]) == k
        got_vals = torch.tensor([v for _, v in pl.top[i]])
        torch.testing.assert_close(got_vals, top_vals, rtol=0, atol=TOL)
        for (tok, v), ref_tok in zip(pl.top[i], top_ids.tolist(), strict=True):
            assert tok == ref_tok or abs(float(row[tok]) - v) < TOL  # a near-tie may swap
    return delta


def _reference(base, adapters, prompts, names) -> list[torch.Tensor]:
    peft = peft_reference(base, adapters)
    return [prompt_log_softmax(peft, p, n) for p, n in zip(prompts, names, strict=True)]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("setup", ["whole", "chunked", "prefix_hit", "lm_head_passes"])
def test_prompt_logprobs_match_hf_peft(kind, setup, tiny_models, tiny_adapters, monkeypatch):
    adapters = tiny_adapters[kind]
    if setup == "lm_head_passes":  # passes of 4 rows, some holding two requests' rows
        monkeypatch.setattr(scoring, "ROWS_PER_CHUNK", 4)
    prompts, loras = _prompts(), _loras(adapters, ADAPTERS)
    chunk = {"max_num_batched_tokens": 7} if setup == "chunked" else {}
    llm = LLM(str(tiny_models[kind]), dtype="float32", max_loras=2, block_size=8, **chunk)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    if setup == "prefix_hit":
        llm.generate(prompts, plain, loras)  # the prompts' full blocks go into the cache
        again = llm.generate(prompts, plain, loras)
        assert all(o.num_cached_tokens >= 8 for o in again), "the cache serves these prompts"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(prompts, params, loras)
    refs = _reference(tiny_models[kind], adapters, prompts, ADAPTERS)
    for out, prompt, ref in zip(outs, prompts, refs, strict=True):
        check_against(out.prompt_logprobs, prompt, ref, K)
        assert len(out.outputs[0].token_ids) == 4  # and it generates as usual
    if setup == "prefix_hit":
        assert all(o.num_cached_tokens == 0 for o in outs), "scored rows must be computed"
        # Once scored, the prompt's blocks serve later requests again.
        assert all(o.num_cached_tokens >= 8 for o in llm.generate(prompts, plain, loras))
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_prompt_recomputed_after_preemption_is_scored_once(tiny_models, tiny_adapters):
    kind = "llama"
    prompts = _prompts((30, 30, 30, 30))
    names = [None, "qv4", None, "attn8"]
    llm = LLM(
        str(tiny_models[kind]), dtype="float32", max_loras=2, block_size=8,
        max_model_len=64, num_kv_blocks=10, max_num_batched_tokens=16,
    )  # fmt: skip
    mid_scoring = []
    preempt = llm.engine.scheduler._preempt

    def spy(seq, out):
        if not seq.prompt_scored:
            mid_scoring.append(len(seq.prompt_logprobs))
        preempt(seq, out)

    llm.engine.scheduler._preempt = spy
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, params, _loras(tiny_adapters[kind], names))
    assert any(n > 1 for n in mid_scoring), "the tiny pool should preempt a partly scored prompt"
    refs = _reference(tiny_models[kind], tiny_adapters[kind], prompts, names)
    for out, prompt, ref in zip(outs, prompts, refs, strict=True):
        check_against(out.prompt_logprobs, prompt, ref, 2)


def test_samples_share_one_scoring_and_max_tokens_zero_only_scores(tiny_models, tiny_adapters):
    kind = "gemma3"
    (prompt,) = _prompts((21,))
    lora = _loras(tiny_adapters[kind], ["attn8"])
    llm = LLM(str(tiny_models[kind]), dtype="float32", block_size=8)
    (ref,) = _reference(tiny_models[kind], tiny_adapters[kind], [prompt], ["attn8"])

    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=5, prompt_logprobs=3)
    (out,) = llm.generate([prompt], params, lora)
    check_against(out.prompt_logprobs, prompt, ref, 3)
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]
    assert llm.engine.num_prompt_tokens_computed == len(prompt)  # one prompt pass for all 3

    score = SamplingParams(n=2, max_tokens=0, prompt_logprobs=3)
    (only,) = llm.generate([prompt], score, lora)
    check_against(only.prompt_logprobs, prompt, ref, 3)
    ended = [(c.token_ids, c.finish_reason, c.text) for c in only.outputs]
    assert ended == [([], "length", "")] * 2
    assert only.num_generated_tokens == 0
    # Without prompt logprobs it computes the prompt only: the prefix cache holds it after.
    (warm,) = llm.generate([prompt], SamplingParams(max_tokens=0))
    assert warm.outputs[0].token_ids == [] and warm.prompt_logprobs is None
    (hit,) = llm.generate([prompt], SamplingParams(max_tokens=1))
    assert hit.num_cached_tokens == 16
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_logprobs=-1), "prompt_logprobs must be between 0 and 20"),
        (dict(prompt_logprobs=21), "prompt_logprobs must be between 0 and 20"),
        (dict(prompt_logprobs="2"), "prompt_logprobs must be an integer or None"),
        (dict(max_tokens=-1, prompt_logprobs=1), "max_tokens must be >= 1"),
        (dict(max_tokens=0, prompt_logprobs=1, n=1, best_of=2), "best_of ranks"),
    ],
)
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_delta_messages_send_prompt_logprobs_once(tiny_models):
    engine = LLMEngine(EngineConfig(str(tiny_models["llama"]), dtype="float32", block_size=8))
    (prompt,) = _prompts((19,))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=4)
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    encoder, decoder = OutputEncoder(), OutputDecoder()
    deltas = [StepMessage(outputs=[encoder.encode(o)]).to_json() for o in outs]
    sent = [StepMessage.from_json(raw).outputs[0] for raw in deltas]
    assert [d.prompt_logprobs is not None for d in sent] == [True] + [False] * (len(outs) - 1)
    assert [decoder.decode(d) for d in sent] == outs  # every output carries them, equal


def _offline(model: str, prompt, params) -> RequestOutput:
    engine = LLMEngine(EngineConfig(model, dtype="float32", seed=3))
    engine.add_request("r", prompt, params)
    while engine.has_unfinished():
        outs = engine.step()
    return outs[-1]


async def _stream(engine, prompt, params) -> list:
    return [out async for out in engine.generate(prompt, params, None)]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_server_engines_return_the_offline_prompt_logprobs(mode, tiny_models):
    model = str(tiny_models["llama"])
    (prompt,) = _prompts((26,))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=3)
    want = _offline(model, prompt, params)
    config = EngineConfig(model, dtype="float32", seed=3)
    engine = EngineProcess(config) if mode == "process" else AsyncLLMEngine(LLMEngine(config))
    score = SamplingParams(max_tokens=0, prompt_logprobs=3)
    try:
        outs = asyncio.run(_stream(engine, prompt, params))
        scored = asyncio.run(_stream(engine, prompt, score))
    finally:
        engine.shutdown()
    assert all(o.prompt_logprobs == want.prompt_logprobs for o in outs)
    assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
    assert scored[-1].finished and scored[-1].outputs[0].token_ids == []
    assert scored[-1].prompt_logprobs == want.prompt_logprobs
