"""bf16 linear layers pre-packed for oneDNN on the CPU: same results, plain weight dropped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine import LLM, LoRARequest, SamplingParams, loader
from loraplex.engine.models.layers import (
    LoRALinear,
    PackedLoRALinear,
    cpu_can_prepack_bf16,
    prepack_cpu_linears,
)
from loraplex.engine.quantization import resident_weight_bytes

needs_packing = pytest.mark.skipif(
    not cpu_can_prepack_bf16(),
    reason="oneDNN cannot pack bf16 weights on this CPU (needs avx512bw/vl/dq or avx_ne_convert)",
)


def test_a_cpu_that_cannot_pack_keeps_every_layer_plain(monkeypatch):
    from loraplex.engine.models import layers

    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")

    monkeypatch.setattr(layers, "_pack", refuse)
    layers.cpu_can_prepack_bf16.cache_clear()
    try:
        model = torch.nn.Sequential(LoRALinear(32, [16], False).to(torch.bfloat16))
        assert prepack_cpu_linears(model) == 0
        assert type(model[0]) is LoRALinear and model[0].weight is not None
    finally:
        layers.cpu_can_prepack_bf16.cache_clear()


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_packed_base_is_bitwise_f_linear(bias):
    gen = torch.Generator().manual_seed(0)
    lin = LoRALinear(96, [64, 32], bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 96, generator=gen) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(96, generator=gen))
    lin = lin.to(torch.bfloat16)
    model = torch.nn.Sequential(lin)
    assert prepack_cpu_linears(model) == 1
    packed = model[0]
    assert isinstance(packed, PackedLoRALinear) and packed.weight is None
    for rows in (1, 7, 64, 130):
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        assert torch.equal(packed.base(x), F.linear(x, lin.weight, lin.bias))


def test_float32_and_quantized_layers_stay_plain():
    model = torch.nn.Sequential(LoRALinear(32, [16], False))  # float32: packing rounds apart
    assert prepack_cpu_linears(model) == 0
    assert type(model[0]) is LoRALinear


@needs_packing
def test_packed_engine_generates_exactly_what_the_plain_one_does(
    tiny_models, tiny_adapters, monkeypatch
):
    kind = "qwen2"  # q/k/v biases
    adapter = LoRARequest("all2", 1, str(tiny_adapters[kind]["all2"]))
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 120, 64]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5)
    # One attention form for both ("auto" times them at start and could pick either).
    settings = dict(dtype="bfloat16", cpu_float32_compute=False, cpu_attention="matmul")
    packed_llm = LLM(str(tiny_models[kind]), **settings)
    model = packed_llm.engine.model
    layers = len(model.model.layers)
    assert sum(isinstance(m, PackedLoRALinear) for m in model.modules()) == 4 * layers
    packed = packed_llm.generate(prompts, params, [adapter, None])

    monkeypatch.setattr(loader, "prepack_cpu_linears", lambda model: 0)
    plain_llm = LLM(str(tiny_models[kind]), **settings)
    assert not any(isinstance(m, PackedLoRALinear) for m in plain_llm.engine.model.modules())
    plain = plain_llm.generate(prompts, params, [adapter, None])
    for p, q in zip(packed, plain, strict=True):
        assert p.outputs[0].token_ids == q.outputs[0].token_ids
        assert p.outputs[0].logprobs == q.outputs[0].logprobs  # bitwise
    assert resident_weight_bytes(model) == resident_weight_bytes(plain_llm.engine.model)
