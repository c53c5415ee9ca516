"""Pre-quantized checkpoints (GPTQ, AWQ, FP8) against transformers + peft on the reference
dequantization of the same checkpoint.

The checkpoints are written from a float test model by tests/utils/quant_checkpoints.py from
the published format descriptions (no GPTQ / AWQ quantizer installs on a CPU-only torch), and
the reference reads them back with its own plain index arithmetic into a float folder that
transformers loads. The engine, loading the quantized folder as is, must match it within float
rounding (float32, the exact reference dispatch path): prefill and decode logits and greedy
tokens of a batch mixing four adapters with rows that have none.
"""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.engine import LLM
from loraplex.engine.weights.formats import checkpoint_quantization
from loraplex.engine.weights.quantization import (
    WeightOnlyFp8Linear,
    WeightOnlyInt4Linear,
    resident_weight_bytes,
)
from testkit.factories import make_adapter, make_tiny_model
from tests.conftest import ADAPTER_SPECS
from tests.engine.test_parity import check_rows, hf_reference, run_rows
from tests.utils.quant_checkpoints import (
    assert_fast_path_close,
    dequantize_folder,
    write_quantized,
)

# Wider than the shared tiny models so that group 128 fits: K is 128 (attention, gate/up)
# or 256 (down_proj).
WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32)

CASES = {
    "gptq-g128": dict(method="gptq"),
    "gptq-g128-act-order": dict(method="gptq", act_order=True),  # down_proj: 2 groups, permuted
    "gptq-v2-g32-act-order": dict(method="gptq", act_order=True, v2=True, group_size=32),
    "awq-g128": dict(method="awq"),
    "awq-g64": dict(method="awq", group_size=64),
    "fp8-channel": dict(method="fp8"),
    "fp8-tensor": dict(method="fp8", fp8_scales="tensor"),
    "fp8-block": dict(method="fp8", fp8_scales="block"),
}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """kind -> (float model folder, adapters by name), for llama and gemma3 (tied head)."""
    root = tmp_path_factory.mktemp("wide")
    out = {}
    for i, kind in enumerate(("llama", "gemma3")):
        base = make_tiny_model(kind, root / kind, seed=20 + i, **WIDE)
        adapters = {
            name: make_adapter(base, root / f"{kind}-{name}", seed=30 + j, **spec)
            for j, (name, spec) in enumerate(ADAPTER_SPECS.items())
        }
        out[kind] = (base, adapters)
    return out


def _folders(wide, kind: str, case: str, tmp_path):
    base, adapters = wide[kind]
    quantized = write_quantized(base, tmp_path / case, **CASES[case])
    return quantized, dequantize_folder(quantized, tmp_path / f"{case}-reference"), adapters


def _llm(folder, **options) -> LLM:
    return LLM(str(folder), dtype="float32", max_loras=4, max_lora_rank=16, **options)


def _reference_weights(reference) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(reference / "model.safetensors")


@pytest.mark.parametrize("case", list(CASES))
def test_loaded_weights_equal_the_reference_dequantization(case, wide, tmp_path):
    quantized, reference, _ = _folders(wide, "llama", case, tmp_path)
    model = _llm(quantized).engine.model
    want = WeightOnlyFp8Linear if CASES[case]["method"] == "fp8" else WeightOnlyInt4Linear
    ref = _reference_weights(reference)
    for i, layer in enumerate(model.model.layers):
        for fused, parts in (
            (
                layer.self_attn.qkv_proj,
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ),
            (layer.self_attn.o_proj, ("self_attn.o_proj",)),
            (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
            (layer.mlp.down_proj, ("mlp.down_proj",)),
        ):
            assert isinstance(fused, want), "the checkpoint's linears must stay quantized"
            expected = torch.cat([ref[f"model.layers.{i}.{p}.weight"] for p in parts])
            torch.testing.assert_close(fused.dequantize(), expected, rtol=1e-6, atol=1e-7)
    if case == "gptq-v2-g32-act-order":
        assert model.model.layers[0].self_attn.qkv_proj.in_perm is not None
    float_bytes = resident_weight_bytes(LLM(str(wide["llama"][0]), dtype="float32").engine.model)
    assert (
        resident_weight_bytes(model) < (0.5 if want is WeightOnlyInt4Linear else 0.6) * float_bytes
    )


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_reference_dequantization_with_mixed_adapters(
    case, wide, tmp_path, reference_mode
):
    quantized, reference, adapters = _folders(wide, "llama", case, tmp_path)
    check_rows(run_rows(_llm(quantized), adapters), hf_reference(reference, adapters))


def test_gemma3_gptq_act_order_with_tied_head(wide, tmp_path, reference_mode):
    quantized, reference, adapters = _folders(wide, "gemma3", "gptq-v2-g32-act-order", tmp_path)
    check_rows(run_rows(_llm(quantized), adapters), hf_reference(reference, adapters))


def test_fast_cpu_path_tracks_the_exact_one(wide, tmp_path):
    """kernel_mode "auto": the bf16 packed int4 op (with the act-order gather) and the fp8
    widening stay close to the exact float32 path."""
    adapters = wide["llama"][1]
    for case in ("gptq-v2-g32-act-order", "fp8-block"):
        quantized, _, _ = _folders(wide, "llama", case, tmp_path)
        assert_fast_path_close(lambda **mode: _llm(quantized, **mode), adapters["attn8"], case)  # noqa: B023


def test_mismatched_act_order_in_a_fused_projection_falls_back_to_float(wide, tmp_path):
    """q/k/v stored with different act-order permutations cannot share one input gather:
    that projection is kept dequantized in float, equal to the reference's weights."""
    base, adapters = wide["llama"]
    quantized = write_quantized(base, tmp_path / "q", "gptq", act_order=True, group_size=32)
    from safetensors.torch import load_file, save_file

    from tests.utils.quant_checkpoints import _pack_cols, _pack_rows, _rtn

    t = load_file(quantized / "model.safetensors")
    prefix = "model.layers.1.self_attn.k_proj"
    w = load_file(base / "model.safetensors")[f"{prefix}.weight"]
    g_idx = torch.arange(w.shape[1]) % (w.shape[1] // 32)  # another valid act-order grouping
    q, zero, scale = _rtn(w, g_idx, w.shape[1] // 32, lo_zero=1)
    t[f"{prefix}.qweight"], t[f"{prefix}.g_idx"], t[f"{prefix}.scales"] = (
        _pack_rows(q), g_idx.to(torch.int32), scale,
    )  # fmt: skip
    t[f"{prefix}.qzeros"] = _pack_cols(zero - 1, list(range(8)))
    save_file(t, quantized / "model.safetensors", metadata={"format": "pt"})
    reference = dequantize_folder(quantized, tmp_path / "ref")
    model = _llm(quantized).engine.model
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert not isinstance(qkv, WeightOnlyInt4Linear)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, WeightOnlyInt4Linear)
    ref = _reference_weights(reference)
    expected = torch.cat([ref[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(qkv.weight, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "qc,match",
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "only 4-bit"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "not supported"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "only FP8 weights",
        ),
    ],
)
def test_unsupported_formats_are_refused_by_name(qc, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_quantization({"quantization_config": qc})


def test_quantizing_a_quantized_checkpoint_again_is_refused(wide, tmp_path):
    quantized = write_quantized(wide["llama"][0], tmp_path / "q", "awq")
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(quantized), dtype="float32", quantization="int4")
    assert json.loads((quantized / "config.json").read_text())["quantization_config"]
