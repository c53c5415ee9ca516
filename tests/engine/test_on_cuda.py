"""On CUDA (`pytest -m gpu`, run by scripts/gpu_check.sh), what `loraplex serve` relies on
there: an engine left on device "auto" lands on the GPU and decodes through CUDA graphs
captured per batch bucket, with adapters mixed in the batch and four adapters taking turns in
two slots (a slot's new contents need no recapture; every bucket is captured at start),
token for token and within float32 rounding of the same engine run eagerly; its KV pool is
sized by gpu_memory_utilization.
No hypothesis here: the device image may lack it (tests/engine/test_graph_decode.py draws
the CPU emulation's runs)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from tests.utils.outputs import assert_same_outputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ADAPTERS = ["qv4", "attn8", "mlp16", "all2"]


def test_cuda_graph_decode_equals_eager_with_mixed_adapters(tiny_models, tiny_adapters):
    args = dict(dtype="float32", max_loras=2, max_lora_rank=16, block_size=8, max_num_seqs=8,
                max_model_len=96)  # fmt: skip
    base = str(tiny_models["llama"])
    graphs = LLM(base, device="auto", **args)
    eager = LLM(base, device="cuda", enforce_eager=True, **args)
    runner = graphs.engine.runner
    assert graphs.engine.model.device.type == "cuda"
    assert runner.graphs is not None and runner.graphs.capture
    assert eager.engine.runner.graphs is None
    # captured at start, every bucket with and without LoRA: none waits for its first step
    made = {(b, lora, False) for b in runner.graphs.buckets for lora in (False, True)}
    assert set(runner.graphs.graphs) == made
    captured = dict(runner.graphs.graphs)
    folders = tiny_adapters["llama"]
    names = [None, "qv4", "attn8", None, "mlp16", "all2", "qv4"]
    loras = [None if a is None else LoRARequest(a, ADAPTERS.index(a) + 1, str(folders[a]))
             for a in names]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=gen).tolist() for n in (3, 9, 5, 12, 1, 7, 4)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (12, 5, 9, 14, 3, 11, 7)]  # fmt: skip
    want = eager.generate(prompts, params, loras)
    got = graphs.generate(prompts, params, loras)
    assert_same_outputs(got, want, atol=1e-4, rtol=1e-4)
    assert runner.graphs.replays > 0
    assert all(runner.graphs.graphs[k] is captured[k] for k in made)  # no capture mid-serving


def test_the_kv_pool_takes_the_share_of_the_gpu_it_is_given(tiny_models):
    _, total = torch.cuda.mem_get_info()
    share = 0.3
    llm = LLM(str(tiny_models["llama"]), device="cuda", dtype="bfloat16", max_lora_rank=8,
              max_loras=2, max_model_len=256, max_num_seqs=64,
              gpu_memory_utilization=share)  # fmt: skip
    report = llm.engine.memory
    # the budget is the GPU's share less weights and working memory, not kv_cache_bytes (1 GiB)
    assert 2 << 30 < report.budget_bytes <= share * total
    # a pool that large holds every sequence's whole context (the pool is not the limit)
    assert report.num_kv_blocks == -(-256 // llm.engine.config.block_size) * 64
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
