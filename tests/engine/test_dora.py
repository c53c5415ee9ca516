"""DoRA (peft's use_dora) served exactly: the loader's checks of magnitude vectors, the factor
on a quantized base (int8; against transformers + peft on the engine's dequantized weights),
the graph-ready decode path and the Triton kernels (interpreted on the CPU) beside the eager
CPU path, and no DoRA work in a step without a DoRA row. Parity with transformers + peft on
float bases, beside plain LoRA in one batch: tests/engine/test_parity.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.adapters.lora import AdapterError, load_adapter
from loraplex.engine.models.spec import spec_from_config
from testkit.dora import broken_dora_copy, make_dora_adapter
from testkit.factories import _config
from tests.engine.test_parity import check_rows, hf_reference, run_rows
from tests.engine.test_quantization import dequantized_folder

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def dora(tiny_models, tiny_adapters, tmp_path_factory):
    """llama: two DoRA adapters (q/v rank 4; every module rank 2) and a plain LoRA one."""
    root, base = tmp_path_factory.mktemp("dora"), tiny_models["llama"]
    return {
        "dqv": make_dora_adapter(base, root / "dqv", seed=1),
        "dall": make_dora_adapter(base, root / "dall", r=2, alpha=4, targets=ALL, seed=2),
        "qv4": tiny_adapters["llama"]["qv4"],
    }


def _spec(folder):
    return spec_from_config(json.loads((folder / "config.json").read_text()))


def test_dora_folder_loads_with_a_magnitude_per_module(tiny_models, dora):
    spec = _spec(tiny_models["llama"])
    adapter = load_adapter(dora["dall"], spec, 16, torch.float32)
    assert adapter.use_dora and set(adapter.magnitudes) == set(adapter.weights)
    for (_, target), m in adapter.magnitudes.items():
        assert m.shape == (spec.lora_in_out(target)[1],) and m.dtype == torch.float32
    assert not load_adapter(dora["qv4"], spec, 16, torch.float32).use_dora


@pytest.mark.parametrize(
    ("how", "words"),
    [("shape", ("lora_magnitude_vector", "(63,)", "expected")), ("nan", ("nan",)),
     ("missing", ("no lora_magnitude_vector",)), ("stray", ("use_dora",))],
)  # fmt: skip
def test_bad_magnitude_vectors_are_refused(how, words, tiny_models, dora, tmp_path):
    folder = broken_dora_copy(dora["dqv"], tmp_path / how, how)
    with pytest.raises(AdapterError) as e:
        load_adapter(folder, _spec(tiny_models["llama"]), 16, torch.float32)
    for word in words:
        assert word.lower() in str(e.value).lower()


def test_dora_on_expert_weights_is_refused(tmp_path):
    """peft refuses use_dora with target_parameters; the per-expert form (transformers 4's
    expert Linears) is refused too: the experts' LoRA path has no DoRA epilogue."""
    spec = spec_from_config(_config("mixtral", 512, 2, None, {}).to_dict())
    h, i, r = spec.hidden_size, spec.moe_intermediate_size, 2
    pre = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1"
    save_file({f"{pre}.lora_A.weight": torch.zeros(r, h), f"{pre}.lora_B.weight": torch.zeros(i, r),
               f"{pre}.lora_magnitude_vector": torch.ones(i)},
              tmp_path / "adapter_model.safetensors")  # fmt: skip
    cfg = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 4,
        "use_dora": True,
        "target_modules": ["gate_proj"],
    }
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="DoRA on mixture-of-experts expert weights"):
        load_adapter(tmp_path, spec, 16, torch.float32)


ROWS = ["dqv", "qv4", None, "dall"]


@pytest.mark.parametrize("method", ["int8"])
def test_dora_on_a_quantized_base_matches_peft_on_dequantized_weights(
    method, tiny_models, dora, tmp_path, reference_mode
):
    """The factor is taken against the weights the quantized engine multiplies by: peft on
    the engine's dequantized weights is the reference (int8: per-row scales, clipped)."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32", quantization=method, max_loras=4,
              max_lora_rank=16)  # fmt: skip
    folder = dequantized_folder(llm, tiny_models["llama"], tmp_path / "dequantized")
    check_rows(
        run_rows(llm, dora, rows=ROWS), hf_reference(folder, dora, ROWS), names=ROWS,
        full_prefill=False,
    )  # fmt: skip


def _generate(llm: LLM, dora: dict, rows=ROWS, tokens: int = 6):
    prompts = [[5 + i, 40, 77, 120 + i, 9, 300, 11 + 2 * i][: 3 + i] for i in range(len(rows))]
    loras = [None if n is None else LoRARequest(n, list(dora).index(n) + 1, str(dora[n]))
             for n in rows]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in llm.generate(prompts, params, loras)]


def _same(got, want, tol: float) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs, strict=True):
            assert lg.keys() == lw.keys()
            torch.testing.assert_close(
                torch.tensor(list(lg.values())), torch.tensor(list(lw.values())),
                rtol=tol, atol=tol,
            )  # fmt: skip


def test_graph_ready_decode_applies_dora(tiny_models, dora):
    """The static decode path (what a CUDA graph replays; on the CPU run eagerly from the same
    buffers) equals the ordinary step, with DoRA, plain LoRA and no adapter in one batch, and
    a batch without DoRA takes the forward without the epilogue."""
    args = dict(dtype="float32", max_loras=4, max_lora_rank=16, max_num_seqs=4)
    base = str(tiny_models["llama"])
    eager, graphs = LLM(base, **args), LLM(base, enforce_eager=False, **args)
    _same(_generate(graphs, dora), _generate(eager, dora), 1e-5)
    assert any(dora_key for (_, _, dora_key) in graphs.engine.runner.graphs.graphs)
    _same(_generate(graphs, dora, ["qv4", None]), _generate(eager, dora, ["qv4", None]), 1e-5)
    assert (2, True, False) in graphs.engine.runner.graphs.graphs


def test_triton_kernels_apply_dora(tiny_models, dora):
    """On the Triton backend (the interpreter here; compiled on CUDA) DoRA rows come out as
    on the CPU backend: the epilogue after the SGMV kernels is the same for both."""
    outs = {}
    for m in ("auto", "triton"):
        llm = LLM(str(tiny_models["llama"]), dtype="float32", max_loras=4, max_lora_rank=16,
                  kernel_mode=m)  # fmt: skip
        outs[m] = _generate(llm, dora, tokens=2)
    _same(outs["triton"], outs["auto"], 1e-4)


def test_no_dora_work_without_a_dora_row(tiny_models, dora, monkeypatch):
    """Steps whose rows use no DoRA adapter plan no DoRA rows and call no epilogue, also
    while a DoRA adapter sits in a slot; a DoRA row's step calls it only on its modules."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_loras=4, max_lora_rank=16)
    calls = []
    backend = llm.engine.runner.backend
    real = type(backend).dora_apply
    monkeypatch.setattr(type(backend), "dora_apply",
                        lambda self, *a, **k: calls.append(a) or real(self, *a, **k))  # fmt: skip
    _generate(llm, dora, ["dqv"], tokens=2)
    # q|k|v (q and v slices) in each of the 2 layers, for the prefill and the decode step
    assert len(calls) == 2 * 2
    assert any(llm.engine.adapters.dora_slots)  # still resident
    calls.clear()
    _generate(llm, dora, ["qv4", None], tokens=2)
    assert calls == []


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_a_packed_layer_gives_dora_the_norms_of_its_weight():
    """A pre-packed CPU layer keeps no float weight: DoRA's row norms come from ||W_n||^2
    (kept when it was packed) and W A^T through its own product, and equal the direct ones."""
    from loraplex.engine.adapters.lora import BaseProbe, LoRAAdapter, dora_scales
    from loraplex.engine.models.layers import LoRALinear
    from loraplex.engine.models.packing import PackedLoRALinear, _pack

    gen = torch.Generator().manual_seed(0)
    lin = LoRALinear(160, [64, 32], bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
        lin.bias.copy_(torch.randn(96, generator=gen))
    lin.lora_a = torch.zeros(1, 8, 160)
    packed = PackedLoRALinear(lin, _pack(lin.weight))
    assert packed.weight is None and packed.base_weight() is None
    a, b = torch.randn(4, 160, generator=gen), 0.3 * torch.randn(96, 4, generator=gen)
    key = (0, "q_proj")
    adapter = LoRAAdapter("x", 4, ("q_proj",), {key: (a, b)},
                          magnitudes={key: torch.rand(96, generator=gen) + 0.5})  # fmt: skip
    direct = dora_scales(adapter, lambda *_: lin.weight.detach().float(), torch.float32)
    probe = BaseProbe(packed.weight_sq, packed.base_probe)
    probed = dora_scales(adapter, lambda *_: probe, torch.float32)
    torch.testing.assert_close(probed[key], direct[key], rtol=1e-5, atol=1e-6)
