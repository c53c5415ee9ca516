"""On CUDA (`pytest -m gpu`, run by scripts/gpu_check.sh): an engine left on device "auto"
lands on the GPU and decodes through CUDA graphs captured per batch bucket, with adapters
mixed in the batch and four adapters taking turns in two slots (a slot's new contents need
no recapture), token for token and within float32 rounding of the same engine run eagerly.
No hypothesis here: the device image may lack it (tests/engine/test_graph_decode.py draws
the CPU emulation's runs)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams

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
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert lw.keys() == lg.keys()
            got_lp, want_lp = torch.tensor(list(lg.values())), torch.tensor(list(lw.values()))
            torch.testing.assert_close(got_lp, want_lp, rtol=1e-4, atol=1e-4)
    assert runner.graphs.replays > 0
    assert any(lora for _, lora, _ in runner.graphs.graphs)  # a graph with LoRA active ran
