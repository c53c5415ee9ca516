"""Pre-quantized checkpoints (GPTQ, AWQ, FP8) written from a float test model, and the
reference dequantization of each, both from the published format descriptions.

No GPTQ / AWQ quantizer installs on a CPU-only torch here (gptqmodel pulls a CUDA torch build,
AutoAWQ is archived), so the writers below round to nearest and pack the result exactly as the
formats are documented (AutoGPTQ / gptqmodel `QuantLinear.pack`, AutoAWQ `WQLinear_GEMM`,
compressed-tensors `float-quantized`, transformers' FineGrainedFP8). `dequantize_folder` is the
reference: it reads the packed tensors back with plain per-element index arithmetic (no code
shared with engine/weights/formats.py) into a float folder that transformers loads.

    GPTQ  qweight int32 [K / 8, N]: bits 4j..4j+3 of qweight[i, n] = q[8 i + j, n]
          qzeros  int32 [K / G, N / 8]: bits 4j.. of qzeros[g, c] = zero[g, 8 c + j] (- 1 in v1)
          scales  fp16 [K / G, N], g_idx int32 [K]; W[n, k] = (q[k, n] - zero[g_idx[k], n]) * s
    AWQ   qweight int32 [K, N / 8]: bits 4j.. of qweight[k, c] = q[k, 8 c + ORDER[j]]
          ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros likewise [K / G, N / 8]; groups k // G
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# Projections that read the same input: GPTQ's act-order permutation (from the same X^T X)
# is then the same for them.
SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def _linears(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJ]


def _rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, lo_zero: int):
    """Asymmetric round-to-nearest per (group, output): q [K, N], zero [G, N], scale [G, N]."""
    wt = w.t().float()  # [K, N]
    lo = torch.stack([wt[g_idx == g].amin(0) for g in range(groups)]).clamp(max=0)
    hi = torch.stack([wt[g_idx == g].amax(0) for g in range(groups)]).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(lo_zero, 15)
    q = torch.round(wt / scale.float()[g_idx] + zero[g_idx]).clamp(0, 15)
    return q.to(torch.int64), zero.to(torch.int64), scale


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    k, n = q.shape
    out = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        out |= q[j::8] << (4 * j)
    return _to_int32(out)


def _pack_cols(q: torch.Tensor, order: list[int]) -> torch.Tensor:
    r, n = q.shape
    out = torch.zeros(r, n // 8, dtype=torch.int64)
    for j in range(8):
        out |= q[:, order[j] :: 8] << (4 * j)
    return _to_int32(out)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)  # same bits, signed


def write_quantized(
    src: Path, dst: Path, method: str, *, group_size: int = 128, act_order: bool = False,
    v2: bool = False, fp8_scales: str = "channel", seed: int = 0,
) -> Path:  # fmt: skip
    """Copy the float model in `src` to `dst` with every decoder linear stored in `method`
    ("gptq" | "awq" | "fp8"); fp8_scales "channel" | "tensor" (compressed-tensors) or
    "block" (quant_method fp8, weight_block_size [32, 32])."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    gen = torch.Generator().manual_seed(seed)
    perms: dict[str, torch.Tensor] = {}
    out = {n: t for n, t in tensors.items() if n not in _linears(tensors)}
    for name in _linears(tensors):
        w, prefix = tensors[name], name.removesuffix(".weight")
        n_out, k = w.shape
        if method == "fp8":
            out.update(_fp8(prefix, w, fp8_scales))
            continue
        groups = k // group_size
        g_idx = torch.arange(k) // group_size
        if method == "gptq" and act_order:  # columns sorted by a (random) importance
            parent, proj = prefix.rsplit(".", 1)
            key = f"{parent}.{SAME_INPUT.get(proj, proj)}"
            if key not in perms:
                perms[key] = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perms[key]] = torch.arange(k) // group_size
        q, zero, scale = _rtn(w, g_idx, groups, lo_zero=1 if method == "gptq" and not v2 else 0)
        if method == "gptq":
            out[f"{prefix}.qweight"] = _pack_rows(q)
            out[f"{prefix}.qzeros"] = _pack_cols(zero - (0 if v2 else 1), list(range(8)))
            out[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
            out.setdefault(f"{prefix}.bias", torch.zeros(n_out, dtype=torch.float16))
        else:
            out[f"{prefix}.qweight"] = _pack_cols(q, AWQ_PACK_ORDER)
            out[f"{prefix}.qzeros"] = _pack_cols(zero, AWQ_PACK_ORDER)
        out[f"{prefix}.scales"] = scale
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config(method, group_size, act_order, v2, fp8_scales)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _fp8(prefix: str, w: torch.Tensor, scales: str) -> dict[str, torch.Tensor]:
    w = w.float()
    fmax = torch.finfo(torch.float8_e4m3fn).max
    if scales == "block":
        n, k = w.shape
        blocks = w.view(n // 32, 32, k // 32, 32).abs().amax(dim=(1, 3))  # [n / 32, k / 32]
        s = blocks / fmax
        full = s.repeat_interleave(32, 0).repeat_interleave(32, 1)
        return {
            f"{prefix}.weight": (w / full).to(torch.float8_e4m3fn),
            f"{prefix}.weight_scale_inv": s,
        }
    s = (w.abs().amax(1, keepdim=True) if scales == "channel" else w.abs().amax().view(1)) / fmax
    return {
        f"{prefix}.weight": (w / s).to(torch.float8_e4m3fn),
        f"{prefix}.weight_scale": s,
        f"{prefix}.input_scale": torch.ones(1),  # static activation scale: ignored
    }


def _config(method: str, group_size: int, act_order: bool, v2: bool, fp8_scales: str) -> dict:
    if method == "gptq":
        return {
            "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
            "sym": False, "checkpoint_format": "gptq_v2" if v2 else "gptq",
        }  # fmt: skip
    if method == "awq":
        return {
            "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm",
        }  # fmt: skip
    if fp8_scales == "block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
        }
    weights = {"num_bits": 8, "type": "float", "strategy": fp8_scales, "symmetric": True}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"], "quantization_status": "compressed",
    }  # fmt: skip


def _nibble(word: torch.Tensor, j: torch.Tensor | int) -> torch.Tensor:
    return (word.to(torch.int64) >> (4 * j)) & 0xF  # int64: no sign extension surprises


def dequantize_folder(src: Path, dst: Path) -> Path:
    """The reference: `src` (a folder written as above) as a float32 folder transformers loads."""
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    t = load_file(src / "model.safetensors")
    out = {}
    for name, v in t.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix in ("qweight", "weight") and prefix.split(".")[-1] in PROJ:
            out[f"{prefix}.weight"] = _dequant(t, prefix, qc)
        elif suffix in ("qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv"):
            continue
        elif suffix == "input_scale" or (suffix == "bias" and not v.any()):
            continue  # static activation scales, GPTQ's all-zero bias: not part of W
        else:
            out[name] = v
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _dequant(t: dict[str, torch.Tensor], prefix: str, qc: dict) -> torch.Tensor:
    method = qc["quant_method"]
    if method in ("fp8", "compressed-tensors"):
        w = t[f"{prefix}.weight"].float()
        n, k = w.shape
        if f"{prefix}.weight_scale_inv" in t:
            bn, bk = qc["weight_block_size"]
            s = t[f"{prefix}.weight_scale_inv"].float()
            rows, cols = torch.arange(n) // bn, torch.arange(k) // bk
            return w * s[rows][:, cols]
        return w * t[f"{prefix}.weight_scale"].float().reshape(-1, 1)  # [N, 1] or [1, 1]
    qweight, qzeros = t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"]
    scales = t[f"{prefix}.scales"].float()  # [groups, N]
    n = scales.shape[1]
    if method == "gptq":
        k = qweight.shape[0] * 8
        kk, nn = torch.arange(k).unsqueeze(1), torch.arange(n).unsqueeze(0)
        q = _nibble(qweight[kk // 8, nn], kk % 8)  # [K, N]
        g_idx = t[f"{prefix}.g_idx"].long()
        gg = g_idx.unsqueeze(1)
        zero = _nibble(qzeros[gg, nn // 8], nn % 8)
        if qc.get("checkpoint_format", "gptq") == "gptq":
            zero = zero + 1
        return ((q - zero) * scales[gg, nn]).t().contiguous()
    k = qweight.shape[0]
    slot = torch.tensor([AWQ_PACK_ORDER.index(c) for c in range(8)])  # nibble holding column c
    kk, nn = torch.arange(k).unsqueeze(1), torch.arange(n).unsqueeze(0)
    q = _nibble(qweight[kk, nn // 8], slot[nn % 8])
    gg = kk // (k // scales.shape[0])
    zero = _nibble(qzeros[gg, nn // 8], slot[nn % 8])
    return ((q - zero) * scales[gg, nn]).t().contiguous()


def assert_fast_path_close(make_llm, adapter_path, label: str = "") -> None:
    """The CPU fast kernels (kernel_mode "auto") against the exact reference path, on two
    engines `make_llm(**options)` builds, one per kernel_mode: the top-20 next-token logprobs of
    a mixed batch (one row with an adapter) mostly agree."""
    from loraplex.engine import LoRARequest, SamplingParams

    prompts = [[5, 17, 99, 230, 41, 7], [8, 300, 12]]
    lora = [LoRARequest("attn8", 2, str(adapter_path)), None]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    fast = make_llm(kernel_mode="auto").generate(prompts, params, lora)
    exact = make_llm(kernel_mode="reference").generate(prompts, params, lora)
    for f, e in zip(fast, exact, strict=True):
        top_f, top_e = f.outputs[0].logprobs[0], e.outputs[0].logprobs[0]
        common = set(top_f) & set(top_e)
        assert len(common) >= 15, label
        assert max(abs(top_f[t] - top_e[t]) for t in common) < 0.05, label
