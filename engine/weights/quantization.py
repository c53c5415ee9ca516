"""Weight-only int8 / int4 quantization of the base model's linear layers.

Adapters stay in floating point on top of the quantized base, as QLoRA-style serving does:
only `LoRALinear`'s base matmul changes. Formats (shared with kernels/reference.py and the
Triton dequant kernels):

    int8  per output channel, symmetric     qweight int8 [N, K], scales float [N]
          W[n, k] = qweight[n, k] * scales[n]
    fp8   per output channel, e4m3 (weight-only)  qweight float8_e4m3fn [N, K], scales float [N]
          W[n, k] = qweight[n, k] * scales[n]; or block scales float [N // bn, K // bk]
          (checkpoints quantized that way: W[n, k] = qweight[n, k] * scales[n // bn, k // bk])
    int4  group-wise along K (group G), asymmetric
          qweight uint8 [N, K // 2]: byte j of row n = q[n, 2j] | q[n, 2j + 1] << 4, q in [0, 15]
          scales, zeros float [N, K // G]
          W[n, k] = (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G]

int4 quantizes the weight in a rotated basis (incoherence processing, as in QuIP# and
QuaRot): each group of G input channels is multiplied by the normalised G x G Hadamard matrix
H (orthogonal and symmetric), W_r = W blockdiag(H), and W_r is what gets rounded. A weight
outlier is spread over its whole group, so the group's grid is no longer stretched by it. At
run time the activations take the same rotation, x W^T = (x blockdiag(H)) W_r^T: one small
[.., G] @ [G, G] matmul per linear before the int4 op (about 10 % of the layer's flops at the
demo model's shapes, no extra weight bytes; demo-model generation speed on CPU unchanged within
noise). `dequantize()` returns W (rotated back). GPTQ's result moves a lot with tiny changes,
so it was measured over draws (the rotation times random sign flips): held-out perplexity on the
demo model x1.06-1.10 (mean 1.08) with the rotation, x1.08-1.16 (mean 1.12) without.

On CUDA the dequant kernels run through the engine's kernel backend. On its CPU backend
decode-sized batches run torch's packed ops `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`
(several times faster than a float matmul there, but only with bf16 activations, so
activations and outputs round to bf16); larger batches dequantize the weight per call into a
temporary and use a plain matmul (`*_PACKED_MAX_ROWS`). int4 weights are rounded by GPTQ on
the calibration texts of engine/weights/calibration.py (engine/weights/gptq.py). The int4 op
wants its own byte order (engine/weights/int4_layout.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.models.layers import LoRALinear
from loraplex.engine.models.moe import Experts
from loraplex.engine.weights.calibration import CALIBRATION_TEXTS
from loraplex.engine.weights.gptq import ROUTER_SUFFIX, calibrate_and_quantize, gptq_int4
from loraplex.engine.weights.int4_layout import (
    cpu_int4_block,
    dequantize_cpu_int4,
    from_cpu_int4_layout,
    pack_int4,
    to_cpu_int4_layout,
)
from loraplex.engine.weights.rotation import hadamard, rotate_groups, rotate_xtx
from loraplex.kernels.reference import dequantize_int4, dequantize_int8

METHODS = ("int8", "int4", "fp8")
GROUP_SIZE = 128
log = logging.getLogger("loraplex.engine")


# Clipping a row's range a little trades rare outliers for a finer step everywhere else; on
# the demo model this took the int8 perplexity change from 1.1 % to 0.7 %.
INT8_CLIP_RATIOS = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.85, 0.8)


def quantize_int8(
    w: torch.Tensor, clip_ratios: tuple[float, ...] = INT8_CLIP_RATIOS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8; per row, the clip ratio of least squared error.

    Shape: w [N, K] -> qweight int8 [N, K], scales float32 [N].
    """
    w = w.float()
    amax = w.abs().amax(dim=1)
    best_err = torch.full_like(amax, float("inf"))
    scales = torch.empty_like(amax)
    for r in clip_ratios:
        s = (amax * r / 127).clamp(min=1e-10)  # all-zero rows stay exact
        err = ((torch.round(w / s.unsqueeze(1)).clamp(-127, 127) * s.unsqueeze(1) - w) ** 2).sum(1)
        better = err < best_err
        scales = torch.where(better, s, scales)
        best_err = torch.where(better, err, best_err)
    q = torch.round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(
    w: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 (min/max per group of `group_size` columns).

    Shape: w [N, K], K % group_size == 0 -> qweight uint8 [N, K // 2],
    scales float32 [N, K // G], zeros float32 [N, K // G].
    """
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-10)
    q = torch.round((g - lo.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, 15)
    zeros = lo + 8 * scales  # so that (q - 8) * s + z = q * s + lo
    return pack_int4(q.view(n, k)), scales, zeros


def group_size_for(in_features: int, wanted: int = GROUP_SIZE) -> int:
    """`wanted` if it divides K; else the largest of 64 / 32 that does (small test models)."""
    for g in (wanted, 64, 32):
        if g <= wanted and in_features % g == 0:
            return g
    raise ValueError(
        f"int4 needs in_features divisible by 32 (group size); a layer has {in_features}: "
        "use quantization='int8'"
    )


# CPU: batches of at most this many rows use torch's packed op; bigger ones (prefill)
# dequantize the weight into a temporary of the activations' dtype and run a plain matmul,
# which oneDNN does faster from there on. The crossovers were measured at the demo model's
# shapes in bf16 (docs/benchmarks.md, "Measurements behind choices in the code").
INT8_PACKED_MAX_ROWS = 32
INT4_PACKED_MAX_ROWS = 128


class QuantizedLoRALinear(LoRALinear):
    """A LoRALinear whose base weight lives in int8/int4 buffers; the LoRA slots are unchanged.

    Built from a loaded float LoRALinear, on its device, which it then replaces (the float
    weight is dropped). Moving it to another device afterwards is not supported.
    """

    method: str

    def __init__(self, lin: LoRALinear):
        dtype, device = lin.weight.dtype, lin.weight.device
        self._take_over(lin)
        self.compute_dtype, self.device = dtype, device

    def base(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight this module multiplies by (exactly, before bf16 rounding)."""
        raise NotImplementedError

    def base_weight(self) -> torch.Tensor:
        # DoRA's row norms are of the weight the quantized base computes with
        return self.dequantize()

    def _cpu_fast(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and self.backend.which(x) == "cpu"

    def _planned(self, qweight: torch.Tensor, zeros: torch.Tensor | None, group: int):
        """On CUDA: this weight's planned launcher (KernelBackend.dequant_weight), made at the
        first call and again only when the weight is replaced; None elsewhere, or where it
        could not be made (the per-call wrapper then serves, and the reason is logged once)."""
        kept = getattr(self, "_dequant", None)
        if kept is not None and kept[0] is qweight:
            return kept[1]
        try:
            w = self.backend.dequant_weight(qweight, self.scales, zeros, group)
        except Exception as e:  # noqa: BLE001 - fall back to the per-call wrapper
            log.warning(
                "planned int%d launcher unavailable (%s): per-call wrapper", 4 if zeros is not None
                else 8, e)  # fmt: skip
            w = None
        self._dequant = (qweight, w)
        return w


class WeightOnlyInt8Linear(QuantizedLoRALinear):
    method = "int8"

    def __init__(self, lin: LoRALinear):
        super().__init__(lin)
        q, s = quantize_int8(lin.weight.detach())
        self.register_buffer("qweight", q)  # int8 [N, K]
        self.register_buffer("scales", s)  # float32 [N]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu_fast(x) and x.shape[0] > INT8_PACKED_MAX_ROWS:
            # Per-row scales factor out of the matmul: convert, multiply, scale the output.
            return F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        if self._cpu_fast(x):
            xb = x.to(torch.bfloat16).contiguous()
            y = torch._weight_int8pack_mm(xb, self.qweight, self.scales.to(torch.bfloat16))
            return y.to(x.dtype)
        planned = self._planned(self.qweight, None, 128) if x.is_cuda else None
        if planned is not None and x.stride(-1) == 1:
            return planned(x)
        return self.backend.int8_matmul(x, self.qweight, self.scales)

    def dequantize(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scales)


class WeightOnlyInt4Linear(QuantizedLoRALinear):
    method = "int4"

    def __init__(
        self,
        lin: LoRALinear,
        group_size: int = GROUP_SIZE,
        xtx: torch.Tensor | None = None,
        rotate: bool = True,
        codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        in_perm: torch.Tensor | None = None,
        hadamards: dict | None = None,
    ):
        """Round-to-nearest, or GPTQ when given X^T X [K, K] of calibration inputs; in the
        Hadamard-rotated basis unless `rotate` is False (module docstring).

        `codes` (q uint8 [N, K] in [0, 15], scales, zeros float32 [N, K // group_size]) takes
        an already quantized weight as is (a GPTQ / AWQ checkpoint, engine/weights/formats.py):
        no rotation; `in_perm` int64 [K] then says which input column each stored column
        multiplies (GPTQ act-order: x[..., in_perm] @ W_stored^T = x @ W^T).
        """
        super().__init__(lin)
        # the rotations, shared by the layers of one model (quantize_model passes one dict)
        self.hadamards = {} if hadamards is None else hadamards
        self.rotate = rotate and codes is None
        self.register_buffer("in_perm", in_perm)  # None unless a checkpoint reordered K
        if codes is not None:
            self.group_size = group_size
            q, s, z = pack_int4(codes[0]), codes[1].float(), codes[2].float()
        else:
            self.group_size = group_size_for(self.in_features, group_size)
            q, s, z = self._quantize(lin.weight.detach(), xtx)
        self._store(q, s, z)

    def _quantize(self, w: torch.Tensor, xtx: torch.Tensor | None):
        if self.rotate:
            self._hadamard(self.compute_dtype)  # built now, not inside a CUDA graph capture
            h = self._hadamard(torch.float32)
            w = rotate_groups(w.float(), h)
            xtx = None if xtx is None else rotate_xtx(xtx.float(), h)
        if xtx is None:
            return quantize_int4(w, self.group_size)
        codes, s, lows = gptq_int4(w, xtx, self.group_size)
        return pack_int4(codes), s, lows + 8 * s  # (q - 8) * s + z = q * s + low

    def _store(self, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
        # The CPU op's own layout replaces the canonical one (same bytes, not both resident).
        block = cpu_int4_block() if self.device.type == "cpu" else None
        self.cpu_layout = block is not None and self.out_features % block == 0
        self.register_buffer("qweight", to_cpu_int4_layout(q) if self.cpu_layout else q)
        self.register_buffer("scales", s)  # float32 [N, K // G]
        self.register_buffer("zeros", z)
        if self.cpu_layout:
            sz = torch.stack([s.t(), z.t()], dim=-1).to(torch.bfloat16).contiguous()
            self.register_buffer("scales_and_zeros", sz)  # bf16 [K // G, N, 2]

    def canonical_qweight(self) -> torch.Tensor:
        return from_cpu_int4_layout(self.qweight) if self.cpu_layout else self.qweight

    def _hadamard(self, dtype: torch.dtype) -> torch.Tensor:
        key = (self.group_size, dtype, self.device)
        if key not in self.hadamards:  # one per size/dtype/device, shared by a model's layers
            self.hadamards[key] = hadamard(self.group_size, dtype, self.device)
        return self.hadamards[key]

    def _rotated(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x.to(dtype)
        if self.in_perm is not None:
            x = x.index_select(-1, self.in_perm)
        return rotate_groups(x, self._hadamard(dtype)) if self.rotate else x

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_layout and self._cpu_fast(x) and x.shape[0] > INT4_PACKED_MAX_ROWS:
            w = dequantize_cpu_int4(self.qweight, self.scales, self.zeros, self.group_size, x.dtype)
            return F.linear(self._rotated(x, x.dtype), w)
        if self.cpu_layout and self._cpu_fast(x):
            # The op wants bf16 anyway; a float32 rotation is the faster one on CPU at decode
            # rows (docs/benchmarks.md) and rounds once.
            xb = self._rotated(x, torch.float32).to(torch.bfloat16).contiguous()
            y = torch._weight_int4pack_mm_for_cpu(
                xb, self.qweight, self.group_size, self.scales_and_zeros
            )
            return y.to(x.dtype)
        x = self._rotated(x, x.dtype)
        if x.is_cuda and not self.cpu_layout:
            planned = self._planned(self.qweight, self.zeros, self.group_size)
            if planned is not None and x.stride(-1) == 1:
                return planned(x)
        q = self.canonical_qweight()  # a conversion per call: reference / test path only
        return self.backend.int4_matmul(x, q, self.scales, self.zeros, self.group_size)

    def dequantize(self) -> torch.Tensor:
        w = dequantize_int4(self.canonical_qweight(), self.scales, self.zeros, self.group_size)
        if self.in_perm is not None:  # stored column j multiplies input in_perm[j]
            w = torch.empty_like(w).index_copy_(1, self.in_perm, w)
        return rotate_groups(w, self._hadamard(w.dtype)) if self.rotate else w  # H^-1 = H


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3: each row scaled so its largest magnitude maps to 448.

    Shape: w [N, K] -> qweight float8_e4m3fn [N, K], scales float32 [N].
    """
    w = w.float()
    scales = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)  # all-zero rows stay exact
    q = (w / scales.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from e4m3 [N, K] and per-channel scales [N] or block scales
    [ceil(N / bn), ceil(K / bk)] (the block shape follows from the two shapes)."""
    w = qweight.float()
    if scales.dim() == 1:
        return w * scales.float().unsqueeze(1)
    n, k = w.shape
    bn, bk = -(-n // scales.shape[0]), -(-k // scales.shape[1])
    s = scales.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w * s


class WeightOnlyFp8Linear(QuantizedLoRALinear):
    """e4m3 weights, 1 byte each, widened to the activations' dtype per call (exact: e4m3's
    3 mantissa bits fit bf16's 7). Per-channel scales multiply the output instead of the
    weight; block scales (checkpoints only) are applied to the widened weight."""

    method = "fp8"

    def __init__(
        self, lin: LoRALinear, qweight: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
    ):  # fmt: skip
        super().__init__(lin)
        if qweight is None:
            qweight, scales = quantize_fp8(lin.weight.detach())
        self.register_buffer("qweight", qweight.to(self.device))  # float8_e4m3fn [N, K]
        self.register_buffer("scales", scales.float().to(self.device))  # [N] or blocks

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales.dim() == 1:
            return F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        return F.linear(x, dequantize_fp8(self.qweight, self.scales).to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.qweight, self.scales)


_CLASSES = {
    "int8": WeightOnlyInt8Linear,
    "int4": WeightOnlyInt4Linear,
    "fp8": WeightOnlyFp8Linear,
}


def calibration_sequences(folder: str | Path, max_len: int) -> list[list[int]] | None:
    """engine/weights/calibration.py's texts as token ids of the model's tokenizer (None without
    one)."""
    from loraplex.engine.models.tokenizer import Tokenizer  # jinja2 & co. only when quantizing

    if not (Path(folder) / "tokenizer.json").is_file():
        return None
    tok = Tokenizer.from_dir(folder)
    return [tok.encode(text)[:max_len] for text in CALIBRATION_TEXTS]


def quantize_model(
    model: nn.Module, method: str, calibration: list[list[int]] | None = None
) -> None:
    """Swap every LoRALinear of `model` for its quantized form, in place.

    int4 with `calibration` (token id sequences) runs GPTQ layer by layer (engine/weights/gptq.py;
    the model's rotary tables must be built); without, round-to-nearest. The embedding and
    (tied or not) lm_head stay in floating point.
    """
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS} or None, got {method!r}")
    if method == "int4" and calibration:
        start = time.perf_counter()
        shared: dict = {}
        calibrate_and_quantize(
            model,
            calibration,
            lambda lin, xtx: WeightOnlyInt4Linear(lin, xtx=xtx, hadamards=shared),
        )
        log.info(
            "int4 GPTQ on %d calibration tokens: %.1f s",
            sum(map(len, calibration)),
            time.perf_counter() - start,
        )
        quantize_experts(model, method)
        return
    cls = _CLASSES[method]
    kwargs = {"hadamards": {}} if cls is WeightOnlyInt4Linear else {}
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, LoRALinear)
        and not isinstance(mod, QuantizedLoRALinear)
        and not name.endswith(ROUTER_SUFFIX)
    ]
    with torch.no_grad():
        for name, mod in targets:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, cls(mod, **kwargs))
    quantize_experts(model, method)


class QuantizedExperts(Experts):
    """Routed experts whose weights are int8 / int4 / fp8 per expert (round to nearest: GPTQ's
    calibration has too few tokens per expert to estimate each one's inputs). Each expert's
    rows go through that expert's quantized matmul; expert LoRA is unchanged."""

    def __init__(self, ex: Experts, cls: type[QuantizedLoRALinear], **kwargs):
        nn.Module.__init__(self)
        for name in ("num_experts", "hidden", "inter", "limit", "alpha", "_bound",
                     "gate_up_proj_bias", "down_proj_bias", "lora_gate_up_a", "lora_gate_up_b",
                     "lora_down_a", "lora_down_b", "lora_widths", "lora_gate_up_widths",
                     "lora_down_widths"):  # fmt: skip
            setattr(self, name, getattr(ex, name))

        def quantized(w: torch.Tensor) -> QuantizedLoRALinear:
            lin = LoRALinear(w.shape[1], [w.shape[0]], bias=False)
            lin.weight = nn.Parameter(w.detach(), requires_grad=False)
            return cls(lin, **kwargs)

        self.gate_up_q = nn.ModuleList(quantized(w) for w in ex.gate_up_proj)
        self.down_q = nn.ModuleList(quantized(w) for w in ex.down_proj)
        self.gate_up_proj = self.down_proj = None

    @staticmethod
    def _per_expert(mods: nn.ModuleList, x: torch.Tensor, offs: torch.Tensor, out: int):
        y = x.new_empty(x.shape[0], out)
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                y[start:end] = mods[e].base(x[start:end])
            start = end
        return y

    def base_gate_up(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self._per_expert(self.gate_up_q, x, offs, 2 * self.inter)

    def base_down(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self._per_expert(self.down_q, x, offs, self.hidden)


def quantize_experts(model: nn.Module, method: str) -> int:
    """Swap every float `Experts` of `model` for QuantizedExperts; returns how many."""
    cls = _CLASSES[method]
    targets = [(n, m) for n, m in model.named_modules() if type(m) is Experts]
    with torch.no_grad():
        for name, mod in targets:
            parent, _, child = name.rpartition(".")
            kwargs = {"hadamards": {}} if cls is WeightOnlyInt4Linear else {}
            setattr(model.get_submodule(parent), child, QuantizedExperts(mod, cls, **kwargs))
    return len(targets)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied tensors once); no KV cache, no LoRA."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
