"""Load a Hugging Face safetensors folder into a DecoderLM built on the meta device.

Tensors are read one at a time from the (memory-mapped) files and copied straight into the
model's parameters, converting dtype on the way, so peak memory is the model plus one tensor.
A checkpoint stored quantized (GPTQ, AWQ, FP8: engine/weights/formats.py) allocates no float
weight for its quantized linears: their tensors are collected and converted once into our
weight-only layers after the files are read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from loraplex.engine.models.decoder import DecoderLM
from loraplex.engine.models.packing import prepack_cpu_linears, prepack_cpu_lm_head
from loraplex.engine.models.spec import PROJECTIONS, ModelSpec, spec_from_config
from loraplex.engine.weights.formats import (
    checkpoint_quantization,
    fused_name,
    install,
    quantized_modules,
)
from loraplex.engine.weights.quantization import (
    calibration_sequences,
    quantize_model,
    resident_weight_bytes,
)

# Checkpoint names that load into a slice of one of our fused parameters.
FUSED = {name: where for name, where in PROJECTIONS.items() if where[0] != name}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# FP8 checkpoints may carry KV-cache scales; loraplex keeps its KV cache in the compute dtype.
_IGNORED_QUANT_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale")
log = logging.getLogger("loraplex.engine")


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found pickle files {pickles}; loraplex never unpickles)" if pickles else ""
        raise FileNotFoundError(f"no safetensors weights in {folder}{hint} {missing or ''}")
    return files


# Mixtral's names for the sparse block and its experts' projections
_MIXTRAL = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _expert_target(model: DecoderLM, parts: list[str]):
    """`...mlp.experts.<e>.<gate|up|down>_proj.weight` (one tensor per expert, as published):
    expert e's rows of our fused [experts, out, in] parameter."""
    experts = model.get_submodule(".".join(parts[:-3]))
    e, proj = int(parts[-3]), parts[-2]
    if e >= experts.num_experts:
        return None
    i = experts.inter
    if proj == "down_proj":
        param, rows = experts.down_proj, slice(None)
    elif proj in ("gate_proj", "up_proj"):
        param = experts.gate_up_proj
        rows = slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)
    else:
        return None
    pname = ".".join(parts[:-3]) + (".down_proj" if proj == "down_proj" else ".gate_up_proj")
    return param, (e, rows), pname


def _target(model: DecoderLM, name: str) -> tuple[torch.Tensor, object, str] | None:
    """Our parameter (and the part of it: rows, or expert and rows) for a checkpoint tensor."""
    if name.startswith("language_model."):
        name = name[len("language_model.") :]
    parts = [_MIXTRAL.get(p, p) for p in name.split(".")] if model.spec.is_moe else name.split(".")
    if len(parts) >= 5 and parts[-4] == "experts" and parts[-3].isdigit():
        try:
            return _expert_target(model, parts)
        except AttributeError:
            return None
    if len(parts) >= 2 and parts[-2] in FUSED:
        fused, idx = FUSED[parts[-2]]
        owner = model.get_submodule(".".join(parts[:-2] + [fused]))
        start = sum(owner.out_sizes[:idx])
        param = getattr(owner, parts[-1])
        pname = ".".join(parts[:-2] + [fused, parts[-1]])
        return param, slice(start, start + owner.out_sizes[idx]), pname
    name = ".".join(parts)
    try:
        return model.get_parameter(name), None, name
    except AttributeError:
        return None


# FP4 (e2m1) code -> value, the MXFP4 element format (OCP Microscaling spec)
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 [..., groups, 16] uint8 blocks (two FP4 codes a byte, low nibble first) and
    [..., groups] uint8 power-of-two scales (exponent + 127) -> float32 [..., groups * 32]."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not fit scales "
            f"{tuple(scales.shape)}"
        )
    lut = torch.tensor(_FP4, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., groups, 16, 2]
    values = lut[codes].flatten(-2)  # [..., groups, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.flatten(-2)


def _deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss' gate|up rows [g0, u0, g1, u1, ...] (dim 1) -> [g0, g1, ..., u0, u1, ...]."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def _gpt_oss_experts(name: str, t: torch.Tensor, parts: dict[str, torch.Tensor]):
    """A gpt-oss expert tensor -> (our parameter's name, the tensor in our layout), or None
    while an MXFP4 pair is incomplete. Ours: [experts, out, in], gate rows then up rows;
    gpt-oss stores float weights [experts, in, out] with gate and up interleaved, and MXFP4
    ones as `<param>_blocks` / `<param>_scales` in [experts, out, in] order."""
    for suffix in ("_blocks", "_scales"):
        if name.endswith(suffix):
            base = name.removesuffix(suffix)
            other = base + ("_scales" if suffix == "_blocks" else "_blocks")
            if other not in parts:
                parts[name] = t
                return None
            blocks, scales = (t, parts.pop(other)) if suffix == "_blocks" else (parts.pop(other), t)
            w = dequantize_mxfp4(blocks, scales)
            return base, _deinterleave_rows(w) if base.endswith("gate_up_proj") else w
    if name.endswith("experts.gate_up_proj"):
        return name, _deinterleave_rows(t.transpose(1, 2))
    if name.endswith("experts.down_proj"):
        return name, t.transpose(1, 2)
    if name.endswith("experts.gate_up_proj_bias"):
        return name, _deinterleave_rows(t)
    return name, t


def load_model(
    folder: str | Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    max_len: int = 4096,
    progress: bool = False,
    quantization: str | None = None,
    shard: Callable[[DecoderLM], DecoderLM] | None = None,
) -> DecoderLM:
    """The model in `dtype` on `device`; with `quantization` ("int8" | "int4" | "fp8") its linear
    layers are then quantized in place (peak memory: the float model plus one layer); int4
    runs GPTQ on the texts of engine/weights/calibration.py when the folder has a tokenizer. Without
    quantization, bf16 linear layers on the CPU keep their weights in oneDNN's packed layout
    (same results, less work per matmul; see PackedLoRALinear), and a vocabulary-sized
    lm_head is packed too (PackedHead). `shard` (tensor parallelism, engine/parallel/shard.py)
    turns the loaded float model into this rank's share of it before anything is packed or
    quantized (each rank reads the whole checkpoint and keeps its share)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    spec: ModelSpec = spec_from_config(config)
    for rope in spec.ropes:
        # Past the original context transformers switches the whole batch to LongRoPE's long
        # factors (keys cached before keep the short ones): no per-sequence engine matches that.
        if rope.kind == "longrope" and max_len > rope.original_max_position:
            raise ValueError(
                f"{folder}: LongRoPE models are served up to their original context of "
                f"{rope.original_max_position} tokens (where transformers uses the short "
                f"factors); set max_model_len <= {rope.original_max_position}"
            )
    qc = config.get("quantization_config") or {}
    if spec.family == "gpt_oss" and str(qc.get("quant_method", "")).lower() == "mxfp4":
        # gpt-oss as published: only the experts are MXFP4, dequantized as they load
        # (_gpt_oss_experts); everything else is a float checkpoint
        config = {k: v for k, v in config.items() if k != "quantization_config"}
    stored = checkpoint_quantization(config)
    if stored is not None and quantization is not None:
        raise ValueError(
            f"{folder} is already quantized ({stored.method}); load it with quantization=None"
        )
    if stored is not None and shard is not None:
        raise ValueError(
            f"{folder} is stored quantized ({stored.method}): such checkpoints are not split "
            "across ranks yet; quantize a float checkpoint on load (quantization=...) instead"
        )
    files = weight_files(folder)
    quantized: set[str] = set()
    if stored is not None:
        names = []
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                names += list(f.keys())
        quantized = quantized_modules(names, stored)
    with torch.device("meta"):
        model = DecoderLM(spec).to(dtype)  # no memory yet; to_empty allocates once
        for name in quantized:  # an empty stand-in: no float weight is ever allocated
            lin = model.get_submodule(fused_name(name)[0])
            lin.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    model = model.to_empty(device=device)
    if spec.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight

    expected = {n: p.numel() for n, p in model.named_parameters()}
    loaded: dict[str, int] = dict.fromkeys(expected, 0)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # quantized module -> suffix -> tensor
    mxfp4_parts: dict[str, torch.Tensor] = {}  # gpt-oss: an MXFP4 tensor's blocks or scales
    bar = tqdm(total=len(files), desc="loading weights", disable=not progress, unit="file")
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and spec.tie_embeddings:
                        continue
                    if stored is not None and name.endswith(_IGNORED_QUANT_SUFFIXES):
                        continue
                    module, _, suffix = name.rpartition(".")
                    if module in quantized and suffix != "bias":
                        pending.setdefault(module, {})[suffix] = f.get_tensor(name)
                        continue
                    src = None
                    if spec.family == "gpt_oss" and ".mlp.experts." in name:
                        got = _gpt_oss_experts(name, f.get_tensor(name), mxfp4_parts)
                        if got is None:  # the other half of an MXFP4 pair is still to come
                            continue
                        name, src = got
                    hit = _target(model, name)
                    if module in quantized and (hit is None or hit[0] is None):
                        # GPTQ packers write a bias for every layer; zeros are no bias.
                        if f.get_tensor(name).any():
                            raise ValueError(f"{name}: a bias the model's config has no room for")
                        continue
                    if hit is None:
                        raise ValueError(f"{path.name}: unexpected tensor {name!r}")
                    param, rows, pname = hit
                    dst = param.data[rows] if rows is not None else param.data
                    src = f.get_tensor(name) if src is None else src
                    if tuple(src.shape) != tuple(dst.shape):
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(src.shape)} != model shape "
                            f"{tuple(dst.shape)}; config.json does not match the weights"
                        )
                    dst.copy_(src)
                    loaded[pname] += src.numel()
            bar.update(1)
    bar.close()
    if mxfp4_parts:
        raise ValueError(f"{folder}: MXFP4 tensors without their pair: {sorted(mxfp4_parts)[:3]}")
    missing = [n for n, k in expected.items() if loaded[n] != k]
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks tensors for {missing[:5]}")
    if pending:
        n = install(model, pending, stored)
        log.info("%d linear layers loaded from %s checkpoint tensors", n, stored.method)
    if shard is not None:
        model = shard(model)
    model.build_buffers(torch.device(device), max_len)  # GPTQ calibration runs the model
    if quantization is not None:
        calibration = calibration_sequences(folder, max_len) if quantization == "int4" else None
        quantize_model(model, quantization, calibration)
    else:
        n = prepack_cpu_linears(model)
        if n:
            log.info("%d linear layers pre-packed for oneDNN", n)
    method = quantization or (stored.method if stored is not None else None)
    model.quantization = method  # what the start log and /metrics name the weights' format
    # A tied head packed costs a copy of the table: not where quantization is saving memory.
    if (method is None or not spec.tie_embeddings) and prepack_cpu_lm_head(model):
        log.info(
            "lm_head pre-packed for oneDNN (%s)",
            "one more copy of the tied embedding" if spec.tie_embeddings else "plain copy dropped",
        )
    log.info(
        "resident weights: %.1f MiB (%s, quantization=%s)",
        resident_weight_bytes(model) / 2**20,
        str(dtype).removeprefix("torch."),
        method,
    )
    return model.eval()
