"""Checkpoints someone already quantized: GPTQ, AWQ and FP8, named by config.json's
`quantization_config`, converted once at load into the weight-only layers of
engine/weights/quantization.py.

GPTQ and AWQ become `WeightOnlyInt4Linear` (our int4 layout and kernels, no rotation); FP8
becomes `WeightOnlyFp8Linear`. The int4 kernels want groups of contiguous input columns and
nibbles along K, which neither format stores, so the codes are repacked once at load (a few
ms per layer; the codes, scales and zero points are kept exactly):

    GPTQ  qweight int32 [K // 8, N]   nibble j of qweight[i, n] = q[8 i + j, n]
          qzeros  int32 [K // G, N // 8]  nibble j of qzeros[g, c] = zero[g, 8 c + j]
                  (format "gptq" (v1) stores zero - 1, "gptq_v2" the zero itself)
          scales  float [K // G, N]   g_idx int32 [K]: the group of each input column
          W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]
    AWQ   (GEMM) qweight int32 [K, N // 8], qzeros int32 [K // G, N // 8], scales [K // G, N]
          nibble j of word c holds output column 8 c + AWQ_ORDER[j]; groups are k // G
          W[n, k] = (q[k, n] - zero[k // G, n]) * scales[k // G, n]
    FP8   weight float8_e4m3fn [N, K] with weight_scale [N, 1] / [N] (per channel) or [1] / []
          (per tensor: widened to per channel, exact), or weight_scale_inv [N / bn, K / bk]
          (block-wise, `weight_block_size`); W = weight * scale. input_scale is ignored
          (weight-only serving: activations stay in the compute dtype).

Act-order (GPTQ `desc_act`) makes groups of scattered columns: the columns are sorted by group
(`in_perm`) and the layer gathers its input the same way, x[..., in_perm]. The parts of a fused
projection (q/k/v, gate/up) share one gather, so their g_idx must agree; GPTQ quantizes them
from the same inputs, so they do. If they don't, that projection is kept in floating point,
dequantized, and a warning says so. Our scales and zeros are float32 with
(q - 8) * s + z = (q - zero) * s, i.e. z = (8 - zero) * s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from loraplex.engine.models.layers import LoRALinear
from loraplex.engine.models.spec import PROJECTIONS
from loraplex.engine.weights.quantization import WeightOnlyFp8Linear, WeightOnlyInt4Linear

log = logging.getLogger("loraplex.engine")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) held by nibble j
INT4_GROUPS = (32, 64, 128)  # what the int4 kernels take; multiples of 128 are split to 128


@dataclass(frozen=True)
class CheckpointQuant:
    """What `quantization_config` says about the stored linear weights."""

    method: str  # "gptq" | "awq" | "fp8"
    group_size: int | None = None  # int4 only; None: one group per row (-1 in the config)
    zero_offset: int = 0  # GPTQ v1 stores zero - 1: add 1 back
    block: tuple[int, int] | None = None  # fp8 block-wise scales [bn, bk]

    @property
    def marker(self) -> tuple[str, ...]:
        """Tensor name suffixes that mark a linear as stored quantized."""
        return (
            ("qweight",) if self.method in ("gptq", "awq") else ("weight_scale", "weight_scale_inv")
        )


def checkpoint_quantization(config: dict) -> CheckpointQuant | None:
    """The checkpoint's quantization from its config.json (None: a float checkpoint).

    Raises ValueError for formats loraplex cannot serve, naming what it can.
    """
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    supported = "GPTQ / AWQ (GEMM) 4-bit, FP8 e4m3 (fp8 or compressed-tensors float-quantized)"
    if method in ("gptq", "awq"):
        if int(qc.get("bits", qc.get("w_bit", 4))) != 4:
            raise ValueError(f"{method} checkpoint with bits={qc.get('bits')}: only 4-bit loads")
        g = int(qc.get("group_size", qc.get("q_group_size", 128)))
        group = None if g <= 0 else g
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm" or qc.get("zero_point") is False:
                raise ValueError(
                    f"AWQ version {version!r} (zero_point={qc.get('zero_point')}): only the "
                    "GEMM layout with zero points loads"
                )
            return CheckpointQuant("awq", group)
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r}: 'gptq' or 'gptq_v2' load")
        return CheckpointQuant("gptq", group, zero_offset=1 if fmt == "gptq" else 0)
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoint in {qc.get('fmt')!r}: only e4m3 loads")
        block = qc.get("weight_block_size")
        return CheckpointQuant("fp8", block=tuple(block) if block else None)
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = (qc.get("config_groups") or {}).values()
        weights = [g.get("weights") or {} for g in groups]
        ok = fmt in ("float-quantized", "naive-quantized") and all(
            w.get("type") == "float"
            and int(w.get("num_bits", 0)) == 8
            and w.get("strategy") in ("channel", "tensor", "block")
            for w in weights
        )
        if not weights or not ok:
            raise ValueError(
                f"compressed-tensors format {fmt!r} with weights {weights}: only FP8 weights "
                f"(float, 8 bits, per channel / tensor / block) load; loraplex loads {supported}"
            )
        blocks = {tuple(w["block_structure"]) for w in weights if w.get("strategy") == "block"}
        return CheckpointQuant("fp8", block=blocks.pop() if len(blocks) == 1 else None)
    raise ValueError(f"quant_method {method!r} is not supported; loraplex loads {supported}")


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [8 R, C]: nibble j of packed[r, c] is row 8 r + j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = (packed.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF  # [R, 8, C]
    return q.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_int4_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8 C]: nibble j of packed[r, c] is column 8 c + order[j]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8], nibble order
    if order is not None:
        q = q[..., torch.tensor(order).argsort()]  # column slot i <- nibble order.index(i)
    return q.reshape(packed.shape[0], -1).to(torch.uint8)


@dataclass
class Int4Part:
    """One checkpoint projection in our int4 terms (before fusing)."""

    codes: torch.Tensor  # uint8 [n, K], columns in stored (group-sorted) order
    scales: torch.Tensor  # float32 [n, K // G]
    zeros: torch.Tensor  # float32 [n, K // G], (q - 8) * s + z
    perm: torch.Tensor | None  # int64 [K]: input column of each stored column; None: identity
    group_size: int


def int4_part(tensors: dict[str, torch.Tensor], fmt: CheckpointQuant) -> Int4Part:
    """Decode one GPTQ / AWQ projection (its qweight, qzeros, scales[, g_idx])."""
    scales = tensors["scales"].float()  # [groups, N]
    if fmt.method == "gptq":
        q = unpack_int4_rows(tensors["qweight"])  # [K, N]
        zero = unpack_int4_cols(tensors["qzeros"]).float() + fmt.zero_offset
    else:
        q = unpack_int4_cols(tensors["qweight"], AWQ_ORDER)
        zero = unpack_int4_cols(tensors["qzeros"], AWQ_ORDER).float()
    k, n = q.shape
    groups = scales.shape[0]
    if k % groups or zero.shape[0] != groups or zero.shape[1] < n:
        raise ValueError(f"int4 tensors disagree: qweight {k}x{n}, {groups} groups of scales")
    g = k // groups
    zero = zero[:, :n]
    g_idx = tensors.get("g_idx")
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // g):
        g_idx = g_idx.long()
        if not torch.equal(torch.bincount(g_idx, minlength=groups), torch.full((groups,), g)):
            raise ValueError(f"g_idx does not split the {k} input columns into groups of {g}")
        perm = torch.argsort(g_idx, stable=True)  # group-sorted order
        q = q[perm]
    s, z = scales.t().contiguous(), ((8 - zero) * scales).t().contiguous()
    if g not in INT4_GROUPS:
        if g % 128:
            raise ValueError(f"int4 group size {g} is not supported (32, 64 or a multiple of 128)")
        s, z, g = s.repeat_interleave(g // 128, 1), z.repeat_interleave(g // 128, 1), 128
    return Int4Part(q.t().contiguous(), s, z, perm, g)


def fp8_part(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [n, K], scales [n] per channel or [n / bn, K / bk] per block)."""
    w = tensors["weight"]
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 checkpoint weight in {w.dtype}: only float8_e4m3fn loads")
    if "weight_scale_inv" in tensors:  # block-wise: despite the name, W = weight * scale_inv
        return w, tensors["weight_scale_inv"].float()
    s = tensors["weight_scale"].float()
    if s.dim() == 2 and s.shape[1] != 1:
        return w, s  # block-wise under compressed-tensors' name
    s = s.flatten()
    return w, s.expand(w.shape[0]).clone() if s.numel() == 1 else s


def _fuse_int4(lin: LoRALinear, parts: list[Int4Part]) -> nn.Module:
    first = parts[0]
    same = all(
        p.group_size == first.group_size
        and (p.perm is None) == (first.perm is None)
        and (p.perm is None or torch.equal(p.perm, first.perm))
        for p in parts
    )
    if not same:
        log.warning("fused projection with differing act-order / groups: kept in float")
        w = torch.cat([_dequantize_part(p) for p in parts])
        lin.weight = nn.Parameter(w.to(lin.weight.dtype), requires_grad=False)
        return lin
    codes = (
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
    )
    return WeightOnlyInt4Linear(
        lin, first.group_size, codes=codes, in_perm=first.perm, rotate=False
    )


def _dequantize_part(p: Int4Part) -> torch.Tensor:
    """float32 [n, K] in input-column order."""
    n, k = p.codes.shape
    q = p.codes.float().view(n, -1, p.group_size)
    w = ((q - 8) * p.scales.unsqueeze(-1) + p.zeros.unsqueeze(-1)).view(n, k)
    return w if p.perm is None else torch.empty_like(w).index_copy_(1, p.perm, w)


def _fuse_fp8(lin: LoRALinear, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> nn.Module:
    if len({s.dim() for _, s in parts}) != 1:
        raise ValueError("fused projection mixes block-wise and per-channel fp8 scales")
    return WeightOnlyFp8Linear(
        lin, torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts])
    )


def fused_name(name: str) -> tuple[str, int]:
    """Checkpoint module name -> (our module name, index of the part within it)."""
    name = name.removeprefix("language_model.")
    parent, _, child = name.rpartition(".")
    fused, idx = PROJECTIONS.get(child, (child, 0))
    return f"{parent}.{fused}", idx


def quantized_modules(names: list[str], fmt: CheckpointQuant) -> set[str]:
    """Checkpoint module names (e.g. model.layers.0.self_attn.q_proj) stored quantized."""
    return {n.rsplit(".", 1)[0] for n in names if n.rsplit(".", 1)[-1] in fmt.marker}


def install(
    model: nn.Module, pending: dict[str, dict[str, torch.Tensor]], fmt: CheckpointQuant
) -> int:
    """Replace each fused LoRALinear whose parts are in `pending` (checkpoint module name ->
    its tensors by suffix) by its quantized form, on the model's device; returns how many."""
    by_module: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensors in pending.items():
        ours, idx = fused_name(name)
        by_module.setdefault(ours, {})[idx] = tensors
    for ours, parts in by_module.items():
        lin = model.get_submodule(ours)
        assert isinstance(lin, LoRALinear), ours
        if sorted(parts) != list(range(len(lin.out_sizes))):
            raise ValueError(f"{ours}: some of its projections are quantized, some are not")
        device = lin.weight.device
        ordered = [{k: v.to(device) for k, v in parts[i].items()} for i in range(len(parts))]
        if fmt.method == "fp8":
            decoded = [fp8_part(t) for t in ordered]
            shapes = [tuple(w.shape) for w, _ in decoded]
        else:
            decoded = [int4_part(t, fmt) for t in ordered]
            shapes = [tuple(p.codes.shape) for p in decoded]
        if shapes != [(n, lin.in_features) for n in lin.out_sizes]:
            raise ValueError(f"{ours}: quantized shapes {shapes} do not match config.json")
        new = _fuse_fp8(lin, decoded) if fmt.method == "fp8" else _fuse_int4(lin, decoded)
        parent, _, child = ours.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return len(by_module)
