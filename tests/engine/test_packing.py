"""Linear layers and the lm_head pre-packed for oneDNN on the CPU: same results (bf16
bitwise, float32 within rounding), plain weight dropped where nothing else reads it; float32
layers packed only where that is faster on this CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.models.layers import LoRALinear
from loraplex.engine.models.packing import (
    PACK_FLOAT32_MIN_WEIGHTS,
    PACK_HEAD_MIN_ROWS,
    PackedHead,
    PackedLoRALinear,
    cpu_can_prepack_bf16,
    prepack_cpu_linears,
    prepack_cpu_lm_head,
)
from loraplex.engine.weights import loader
from loraplex.engine.weights.quantization import resident_weight_bytes
from testkit.factories import make_tiny_model
from tests.utils.outputs import assert_same_outputs

needs_packing = pytest.mark.skipif(
    not cpu_can_prepack_bf16(),
    reason="oneDNN cannot pack bf16 weights on this CPU (needs avx512bw/vl/dq or avx_ne_convert)",
)


def test_a_cpu_that_cannot_pack_keeps_every_layer_plain(monkeypatch):
    from loraplex.engine.models import packing

    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")

    monkeypatch.setattr(packing, "_pack", refuse)
    packing.cpu_can_prepack_bf16.cache_clear()
    try:
        model = torch.nn.Sequential(LoRALinear(32, [16], False).to(torch.bfloat16))
        assert prepack_cpu_linears(model) == 0
        assert type(model[0]) is LoRALinear and model[0].weight is not None
    finally:
        packing.cpu_can_prepack_bf16.cache_clear()


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


def _float32_layer(bias: bool, size: int = 512) -> LoRALinear:
    gen = torch.Generator().manual_seed(0)
    lin = LoRALinear(size, [size // 2, size // 2], bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(size, size, generator=gen) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(size, generator=gen))
    return lin


@pytest.mark.parametrize("bias", [False, True])
def test_float32_layer_packs_within_rounding_when_told(bias):
    lin = _float32_layer(bias)
    assert lin.weight.numel() >= PACK_FLOAT32_MIN_WEIGHTS
    model = torch.nn.Sequential(lin)
    assert prepack_cpu_linears(model, float32=True) == 1
    packed = model[0]
    assert isinstance(packed, PackedLoRALinear) and packed.weight is None
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, 64, 130):
        x = torch.randn(rows, 512, generator=gen)
        torch.testing.assert_close(packed.base(x), F.linear(x, lin.weight, lin.bias))


def test_float32_packing_follows_this_cpus_timing(monkeypatch):
    from loraplex.engine.models import packing

    for pays in (False, True):
        monkeypatch.setattr(packing, "packing_pays", lambda w, p, decided=None, pays=pays: pays)
        model = torch.nn.Sequential(_float32_layer(False), _float32_layer(False))
        assert prepack_cpu_linears(model) == (2 if pays else 0)
        assert all(isinstance(m, PackedLoRALinear) == pays for m in model)


def test_packing_pays_times_each_shape_once(monkeypatch):
    from loraplex.engine.models import packing

    calls = []
    real = packing._best_time
    monkeypatch.setattr(packing, "_best_time", lambda fn, x: calls.append(1) or real(fn, x))
    w = _float32_layer(False).weight.detach()
    packed = packing._pack(w)
    decided: dict = {}
    first = packing.packing_pays(w, packed, decided)
    n = len(calls)
    assert n > 0 and packing.packing_pays(w, packed, decided) == first and len(calls) == n


def test_small_or_refused_float32_layers_stay_plain():
    model = torch.nn.Sequential(LoRALinear(32, [16], False))  # a test model's size
    assert prepack_cpu_linears(model, float32=True) == 0
    assert type(model[0]) is LoRALinear
    model = torch.nn.Sequential(_float32_layer(False))
    assert prepack_cpu_linears(model, float32=False) == 0
    assert type(model[0]) is LoRALinear


def _packed_and_plain(tiny_models, tiny_adapters, settings, unpack):
    """Greedy generations (with logprobs) of the qwen2 test model (q/k/v biases) loaded as
    `settings` say, then again after `unpack()`: (packed, plain) outputs and engines."""
    kind = "qwen2"
    adapter = LoRARequest("all2", 1, str(tiny_adapters[kind]["all2"]))
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 120, 64]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5)
    packed_llm = LLM(str(tiny_models[kind]), **settings)
    packed = packed_llm.generate(prompts, params, [adapter, None])
    unpack()
    plain_llm = LLM(str(tiny_models[kind]), **settings)
    plain = plain_llm.generate(prompts, params, [adapter, None])
    return packed, plain, packed_llm.engine.model, plain_llm.engine.model


def _count_packed(model) -> int:
    return sum(isinstance(m, PackedLoRALinear) for m in model.modules())


def _assert_same_within_rounding(packed, plain) -> None:
    assert_same_outputs(packed, plain, atol=1e-4)


@needs_packing
def test_packed_engine_generates_exactly_what_the_plain_one_does(
    tiny_models, tiny_adapters, monkeypatch
):
    # One attention form for both ("auto" times them at start and could pick either).
    settings = dict(dtype="bfloat16", cpu_float32_compute=False, cpu_attention="matmul")
    packed, plain, model, plain_model = _packed_and_plain(
        tiny_models,
        tiny_adapters,
        settings,
        lambda: monkeypatch.setattr(loader, "prepack_cpu_linears", lambda model: 0),
    )
    assert _count_packed(model) == 4 * len(model.model.layers)
    assert _count_packed(plain_model) == 0
    for p, q in zip(packed, plain, strict=True):
        assert p.outputs[0].token_ids == q.outputs[0].token_ids
        assert p.outputs[0].logprobs == q.outputs[0].logprobs  # bitwise
    assert resident_weight_bytes(model) == resident_weight_bytes(plain_model)


def test_float32_engine_with_packed_layers_generates_what_the_plain_one_does(
    tiny_models, tiny_adapters, monkeypatch
):
    from loraplex.engine.models import packing

    monkeypatch.setattr(packing, "PACK_FLOAT32_MIN_WEIGHTS", 0)  # the test model's layers too
    monkeypatch.setattr(packing, "packing_pays", lambda w, packed, decided=None: True)
    packed, plain, model, plain_model = _packed_and_plain(
        tiny_models,
        tiny_adapters,
        dict(dtype="float32", cpu_attention="matmul"),
        lambda: monkeypatch.setattr(packing, "packing_pays", lambda w, p, decided=None: False),
    )
    assert _count_packed(model) == 4 * len(model.model.layers)
    assert _count_packed(plain_model) == 0
    _assert_same_within_rounding(packed, plain)
    assert resident_weight_bytes(model) == resident_weight_bytes(plain_model)


# --------------------------------------------------------------------------- lm_head


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_packing)]
)
def test_packed_head_matches_f_linear(dtype):
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(64, PACK_HEAD_MIN_ROWS, bias=False).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(PACK_HEAD_MIN_ROWS, 64, generator=gen) * 0.1)
    plain = model.lm_head
    assert prepack_cpu_lm_head(model)
    assert isinstance(model.lm_head, PackedHead) and not hasattr(model.lm_head, "weight")
    for rows in (1, 5, 64):
        x = torch.randn(2, rows, 64, generator=gen).to(dtype)  # leading dims kept
        got, want = model.lm_head(x), plain(x)
        assert got.shape == want.shape == (2, rows, PACK_HEAD_MIN_ROWS)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_narrow_or_biased_heads_stay_plain():
    for head in (
        torch.nn.Linear(64, PACK_HEAD_MIN_ROWS // 2, bias=False),  # a test model's vocabulary
        torch.nn.Linear(64, PACK_HEAD_MIN_ROWS, bias=True),
    ):
        model = torch.nn.Module()
        model.lm_head = head
        assert not prepack_cpu_lm_head(model) and model.lm_head is head


@pytest.mark.parametrize("tie", [True, False])
def test_engine_with_a_packed_head_generates_what_the_plain_one_does(tmp_path, monkeypatch, tie):
    folder = make_tiny_model("llama", tmp_path / "m", vocab_size=PACK_HEAD_MIN_ROWS, tie=tie)
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 120, 6400, 64]]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    settings = dict(dtype="float32", cpu_attention="matmul", max_model_len=256)
    packed_llm = LLM(str(folder), **settings)
    model = packed_llm.engine.model
    assert isinstance(model.lm_head, PackedHead)
    packed = packed_llm.generate(prompts, params)

    monkeypatch.setattr(loader, "prepack_cpu_lm_head", lambda model: False)
    plain_llm = LLM(str(folder), **settings)
    plain_model = plain_llm.engine.model
    assert type(plain_model.lm_head) is torch.nn.Linear
    plain = plain_llm.generate(prompts, params)
    _assert_same_within_rounding(packed, plain)
    # The embedding keeps its plain table; a tied head's packed copy is one more table, an
    # untied head's plain weight is gone.
    assert torch.equal(model.model.embed_tokens.weight, plain_model.model.embed_tokens.weight)
    table = plain_model.lm_head.weight.numel() * 4
    extra = resident_weight_bytes(model) - resident_weight_bytes(plain_model)
    assert extra == (table if tie else 0)
