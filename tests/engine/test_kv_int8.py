"""The engine with an int8 KV cache: capacity at the same bytes, and output against the float
cache on tiny models (mixed adapters, chunked prefill, forked samples)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig

ADAPTERS = ["qv4", None, "attn8", "all2"]


def _llm(model, kv_cache_dtype, **kw) -> LLM:
    opts = dict(
        dtype="float32",
        cpu_attention="sdpa",
        max_lora_rank=16,
        max_model_len=256,
        kv_cache_bytes=4 << 20,
    )
    return LLM(str(model), kv_cache_dtype=kv_cache_dtype, **{**opts, **kw})


def _prompts(n: int, length: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (length + 3 * (i % 4),), generator=g).tolist() for i in range(n)]


def test_config_refuses_unknown_kv_dtype(tiny_models):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'int8'"):
        EngineConfig(model=str(tiny_models["llama"]), kv_cache_dtype="fp8")


def test_int8_doubles_tokens_and_concurrency_at_same_bytes(tiny_models):
    """The pool is sized by bytes with the scales counted: more blocks by the bytes ratio, and
    a queue of long requests runs that much wider at once."""
    peak, blocks, ratio = {}, {}, None
    for kv in ("auto", "int8"):
        llm = _llm(tiny_models["llama"], kv, kv_cache_bytes=600 << 10, max_lora_rank=8)
        runner = llm.engine.runner
        blocks[kv] = runner.num_blocks
        attn = runner.model.model.layers[0].self_attn
        held = sum(t.numel() * t.element_size() for t in (attn.k_cache, attn.v_cache,
                   attn.k_scale, attn.v_scale) if t is not None)  # fmt: skip
        # what the runner counts is what the layers really hold
        assert held * len(runner.model.model.layers) == runner.kv_cache_bytes
        d = runner.model.spec.head_dim
        ratio = runner.model.dtype.itemsize * d / (d + 2)  # (d + 2 bytes) per token-head
        engine = llm.engine
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(_prompts(24, 120)):
            engine.add_request(str(i), p, params)
        peak[kv] = 0
        while engine.has_unfinished():
            engine.step()
            peak[kv] = max(peak[kv], len(engine.scheduler.running))
    assert blocks["int8"] == pytest.approx(blocks["auto"] * ratio, rel=0.02)
    assert peak["auto"] >= 3 and peak["int8"] >= 0.85 * ratio * peak["auto"], (peak, ratio)


def test_demo_shape_holds_twice_the_tokens():
    """Gemma 3 270M's KV shape (1 KV head of 256, 18 layers) in bf16 vs int8: >= 1.9x."""
    from loraplex.engine.memory.kv_cache import kv_block_bytes

    spec = SimpleNamespace(num_layers=18, num_kv_heads=1, head_dim=256)
    bf16 = kv_block_bytes(spec, 16, torch.bfloat16, "auto")
    assert bf16 / kv_block_bytes(spec, 16, torch.bfloat16, "int8") >= 1.9


def _generate(llm, adapters, prompts, params):
    reqs = [
        None if name is None else LoRARequest(name, i + 1, str(adapters[name]))
        for i, name in enumerate(ADAPTERS)
    ]
    rows = [reqs[i % len(reqs)] for i in range(len(prompts))]
    outs = llm.generate(prompts, params, lora_request=rows)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_int8_greedy_agrees_with_float_cache(tiny_models, tiny_adapters, kind):
    """Mixed adapters, a prompt longer than the prefill chunk (chunked prefill over int8
    prefix blocks), GQA and (gemma3) sliding windows. Per row, greedy tokens match the float
    cache's with close log-probabilities, and a row may part only where the float cache's
    top two tokens were a near-tie (random tiny weights have many; the demo model's figures
    come from `python -m benchmarks.kv_int8`)."""
    prompts = _prompts(6, 20) + [_prompts(1, 90, seed=9)[0]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = {
        kv: _generate(_llm(tiny_models[kind], kv, max_num_batched_tokens=64),
                      tiny_adapters[kind], prompts, params)
        for kv in ("auto", "int8")
    }  # fmt: skip
    drift, parted = [], 0
    for (fa, la), (fb, lb) in zip(outs["auto"], outs["int8"], strict=True):
        j = next((i for i, (a, b) in enumerate(zip(fa, fb, strict=True)) if a != b), len(fa))
        drift += [abs(la[i][fa[i]] - lb[i][fa[i]]) for i in range(j)]
        if j < len(fa):
            parted += 1
            top = sorted(la[j].values(), reverse=True)
            assert top[0] - top[1] < 0.1, (j, la[j], lb[j])  # a near-tie in the float cache
    assert max(drift) < 0.05 and parted <= 2


def test_int8_forked_samples_copy_scales(tiny_models):
    """n > 1 forks copy the partly filled block, scales included: each greedy sample equals
    the single greedy output (a stale or missing scale row would change them)."""
    llm = _llm(tiny_models["llama"], "int8")
    prompt = _prompts(1, 21)[0]  # 21 tokens: the fork copies a half-filled block
    one = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    many = llm.generate([prompt], SamplingParams(n=3, max_tokens=12, temperature=0.0))
    want = one[0].outputs[0].token_ids
    assert [o.token_ids for o in many[0].outputs] == [want] * 3
