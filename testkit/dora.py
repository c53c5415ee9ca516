"""PEFT DoRA adapters (`use_dora: true`) for tiny test models, and broken ones for upload tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from testkit.factories import _FUSED_TARGETS, _load_base

MAGNITUDE = "lora_magnitude_vector"


@torch.no_grad()
def make_dora_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 4,
    alpha: float = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    init_std: float = 0.1,
) -> Path:
    """Save a PEFT DoRA adapter for `base_dir` with random A, B and magnitude into `out_dir`.

    peft sets m = ||W||_row when it builds the layer (B = 0); random B then makes
    ||W + B A|| differ from m, and m is jittered too, so every factor m / ||W + B A|| is
    away from 1. Split names stand for a checkpoint's fused modules (phi3), as make_adapter."""
    from peft import LoraConfig, get_peft_model

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    model_type = json.loads((base_dir / "config.json").read_text()).get("model_type")
    fused = _FUSED_TARGETS.get(model_type, {})
    targets = tuple(dict.fromkeys(fused.get(t, t) for t in targets))
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
        use_dora=True, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(_load_base(base_dir), config)
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            param.copy_(init_std * torch.randn(param.shape, generator=gen))
        elif MAGNITUDE in name:
            param.mul_(1 + 0.2 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def broken_dora_copy(good: Path, out: Path, how: str) -> Path:
    """A copy of DoRA adapter `good` with one magnitude vector broken: "shape" (one row
    short), "nan", "missing" (dropped) or "stray" (use_dora set false, vectors kept)."""
    shutil.copytree(good, out)
    weights = load_file(out / "adapter_model.safetensors")
    key = sorted(k for k in weights if k.endswith(MAGNITUDE))[0]
    if how == "shape":
        weights[key] = weights[key][:-1].clone()
    elif how == "nan":
        weights[key] = weights[key].clone()
        weights[key][0] = float("nan")
    elif how == "missing":
        del weights[key]
    elif how == "stray":
        cfg = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": False}))
    else:
        raise ValueError(how)
    save_file(weights, out / "adapter_model.safetensors")
    return out
