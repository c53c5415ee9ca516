"""The later families' switches against transformers' own config classes, and what a user sees
when a checkpoint or adapter does not fit (token parity itself: test_parity, test_differential).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from loraplex.engine import LLM
from loraplex.engine.adapters.lora import AdapterError, load_adapter
from loraplex.engine.models.layers import inv_frequencies
from loraplex.engine.models.spec import ModelSpec, spec_from_config
from loraplex.platform.uploads.policy import UploadError
from loraplex.platform.uploads.validate import check_base_model, validate_adapter

_QWEN3 = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512)  # fmt: skip


def _spec(folder: Path) -> ModelSpec:
    return spec_from_config(json.loads((folder / "config.json").read_text()))


def _saved(config: transformers.PretrainedConfig, tmp_path: Path) -> dict:
    """The config.json transformers writes for `config` (what the engine reads)."""
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize(
    "cls, rope, extra",
    [
        (transformers.Qwen3Config, {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 128}, {}),
        # DeepSeek-style mscale pair, a narrow ramp, no rounding of its ends
        (transformers.Qwen3Config, {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707,
                                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
                                    "truncate": False,
                                    "original_max_position_embeddings": 64}, {}),
        (transformers.Qwen3Config, {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.9,
                                    "original_max_position_embeddings": 256}, {}),
        # no `original_max_position_embeddings`: transformers takes max_position_embeddings
        (transformers.LlamaConfig, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0}, {}),
        (transformers.Phi3Config, {"rope_type": "default", "partial_rotary_factor": 0.5}, {}),
        (transformers.Qwen3Config, {"rope_type": "linear", "factor": 3.0}, {}),
        # Phi-4-mini's layout: partial rotary, the original length at the config's top level
        (transformers.Phi3Config, {"rope_type": "longrope", "partial_rotary_factor": 0.75,
                                   "short_factor": [1.0, 1.2, 1.9, 2.5, 4.0, 7.5],
                                   "long_factor": [1.0, 3.0, 5.0, 9.0, 17.0, 40.0]},
         {"original_max_position_embeddings": 64}),
        # Phi-3.5-mini's older name for it
        (transformers.Phi3Config, {"rope_type": "su", "short_factor": [1.1] * 8,
                                   "long_factor": [2.0] * 8},
         {"original_max_position_embeddings": 100}),
    ],
    ids=["yarn", "yarn-mscale", "yarn-attention-factor", "llama3-default-length", "partial",
         "linear", "longrope", "longrope-su"],
)  # fmt: skip
def test_rope_frequencies_and_scaling_match_transformers(cls, rope, extra, tmp_path):
    config = cls(**_QWEN3, rope_parameters={"rope_theta": 10_000.0, **rope}, **extra)
    spec = spec_from_config(_saved(config, tmp_path))
    fn = ROPE_INIT_FUNCTIONS.get(config.rope_parameters["rope_type"])
    if fn is None:  # "default": the model's own (Phi-3's honours partial_rotary_factor)
        fn = Phi3RotaryEmbedding.compute_default_rope_parameters
    want_inv, want_scale = fn(config, torch.device("cpu"))
    r = spec.ropes[0]
    got = inv_frequencies(r, r.rotary_dim(spec.head_dim))
    torch.testing.assert_close(got, want_inv.float(), rtol=1e-7, atol=0)
    assert r.attention_factor == pytest.approx(want_scale, rel=1e-12)


def test_qwen3_sliding_window_layers_match_transformers(tmp_path):
    """Published Qwen3 configs carry `sliding_window` with `use_sliding_window: false`: no layer
    is windowed then, and with it on only layers from `max_window_layers` are."""
    for use, first in ((False, 1), (True, 1)):
        config = transformers.Qwen3Config(**_QWEN3, sliding_window=8, use_sliding_window=use,
                                          max_window_layers=first)  # fmt: skip
        want = [8 if t == "sliding_attention" else None for t in config.layer_types]
        saved = _saved(config, tmp_path)
        assert list(spec_from_config(saved).windows) == want
        legacy = {**saved, "sliding_window": 8}  # as transformers 4.x wrote them
        legacy.pop("layer_types")
        assert list(spec_from_config(legacy).windows) == want
    assert want == [None, 8]


def test_longrope_is_served_up_to_its_original_context(family_models):
    """Beyond it transformers switches a whole batch to the long factors, keeping the keys
    cached before: the engine says how long a context it serves instead of differing."""
    with pytest.raises(ValueError, match="original context of 128 tokens.*max_model_len <= 128"):
        LLM(str(family_models["phi3_longrope"]), dtype="float32", max_model_len=129)
    config = json.loads((family_models["phi3_longrope"] / "config.json").read_text())
    config["rope_parameters"]["short_factor"] = [1.0] * 8  # the rotary width is 12
    with pytest.raises(ValueError, match="short_factor has 8 entries.*needs 6"):
        spec_from_config(config)


def _edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_fused_module_adapter_targets(family_models, family_adapters, tmp_path):
    """Phi-3 adapters name the fused modules; a split name is no module of Phi-3 (and a fused
    one none of Qwen3's), and norms are never targets: each refusal says what the base has."""
    phi3, qwen3 = _spec(family_models["phi3"]), _spec(family_models["qwen3"])
    good = family_adapters["phi3"]["all2"]
    adapter = load_adapter(good, phi3, 16, torch.float32)
    assert adapter.targets == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    # One A per fused module, shared by its slices: the size counts it once.
    assert adapter.nbytes == sum(
        t.nbytes for t in load_file(good / "adapter_model.safetensors").values()
    )
    split = _edited(good, tmp_path / "split", target_modules=["q_proj", "v_proj"])
    with pytest.raises(AdapterError, match=r"'q_proj' does not exist.*qkv_proj, o_proj"):
        load_adapter(split, phi3, 16, torch.float32)
    # Phi-3's weights on a Qwen3 base: refused by name before any shape is compared.
    with pytest.raises(
        AdapterError, match=r"'(qkv|gate_up)_proj' is not supported \(qwen3\); supported: q_proj"
    ):
        load_adapter(good, qwen3, 16, torch.float32)
    norm = _edited(family_adapters["qwen3"]["qv4"], tmp_path / "norm",
                   target_modules=["q_proj", "v_proj", "q_norm"])  # fmt: skip
    with pytest.raises(AdapterError, match="'q_norm' is not supported"):
        load_adapter(norm, qwen3, 16, torch.float32)


def test_upload_validation_knows_the_new_families(family_models, family_adapters):
    phi3, qwen3 = _spec(family_models["phi3"]), _spec(family_models["qwen3"])
    ok = validate_adapter(family_adapters["phi3"]["qv4"], phi3, max_rank=16,
                          base_model_name="phi-base", max_bytes=10**8)  # fmt: skip
    assert ok.targets == ("qkv_proj",) and ok.rank == 4
    for name, spec in (("microsoft/Phi-3-mini-4k-instruct", phi3), ("microsoft/phi-4", phi3),
                       ("Qwen/Qwen3-8B", qwen3)):  # fmt: skip
        check_base_model(name, spec, "served")
    for name, spec in (("microsoft/phi-2", phi3), ("meta-llama/Llama-3.2-1B", phi3),
                       ("Qwen/Qwen2.5-7B", qwen3), ("microsoft/Phi-4-mini", qwen3)):  # fmt: skip
        with pytest.raises(UploadError) as e:
            check_base_model(name, spec, "served")
        assert e.value.status_code == 422 and e.value.code == "base_model_mismatch"
