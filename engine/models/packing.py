"""oneDNN pre-packing of the CPU's linear layers and LM head: the same results as F.linear, less
work per matmul where the CPU and the shapes make it pay (measured: docs/cpu-path.md)."""

from __future__ import annotations

import functools
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.models.layers import LoRALinear


class PackedLoRALinear(LoRALinear):
    """A LoRALinear on the CPU whose base weight is stored pre-packed in oneDNN's blocked
    layout, built from a loaded LoRALinear that it then replaces (the plain weight is dropped).

    `F.linear` re-packs a bf16 weight on every call; packing once gives bitwise the same
    results and saves that work, which counts most at decode-sized rows. In float32,
    F.linear runs MKL's GEMM and the packed form oneDNN's (equal within float32 rounding),
    which is faster at decode-sized rows on some CPUs and not on others, hence the timed probe.
    Figures: docs/cpu-path.md and docs/benchmarks.md ("Measurements behind choices in the
    code"). Use `prepack_cpu_linears`, which decides per layer.
    """

    def __init__(self, lin: LoRALinear, packed: torch.Tensor):
        self._take_over(lin)
        self.register_buffer("packed", packed, persistent=False)

    def base(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed, self.bias)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)  # 64: the rows hint


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """F.linear(x, W, bias) for W packed by `_pack` (oneDNN, no fused activation)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def cpu_can_prepack_bf16() -> bool:
    """Whether this CPU and torch build can keep bf16 weights packed for oneDNN.

    oneDNN's bf16 linear needs avx512bw/vl/dq or avx_ne_convert; on a plain AVX2 CPU torch
    refuses to pack ("bf16 path needs the cpu support ...") and layers stay plain.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        _pack(torch.zeros(8, 8, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def _close_to_f_linear(got: torch.Tensor, want: torch.Tensor) -> bool:
    """float32 packed vs F.linear: within float32 rounding (1e-5 of the largest output)."""
    return bool((got - want).abs().max() <= 1e-5 * want.abs().max().clamp(min=1e-30))


# float32 layers smaller than this stay plain (test models): the gain is in layers whose
# weight streams from memory, and small test models keep one deterministic path.
PACK_FLOAT32_MIN_WEIGHTS = 1 << 18
# Rows at which a float32 layer is timed both ways (decode batches, a small prefill chunk);
# the packed form is kept when the geometric mean of its time ratios is below the margin.
PACK_TIMING_ROWS = (8, 32, 128)
PACK_FLOAT32_MARGIN = 0.95


def _best_time(fn, x: torch.Tensor, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best


def packing_pays(weight: torch.Tensor, packed: torch.Tensor, decided: dict | None = None) -> bool:
    """Whether oneDNN's packed float32 product beats F.linear on this CPU for this shape,
    timed at `PACK_TIMING_ROWS` (interleaved, best of several runs). `decided`: the answers
    so far for one model (per shape and thread count), so its layers of one shape decide
    alike and each shape is timed once."""
    decided = {} if decided is None else decided
    key = (*weight.shape, torch.get_num_threads())
    if key not in decided:
        gen = torch.Generator().manual_seed(0)
        ratios = []
        for rows in PACK_TIMING_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=gen)
            plain, fast = float("inf"), float("inf")
            for _ in range(2):
                plain = min(plain, _best_time(lambda v: F.linear(v, weight), x))
                fast = min(fast, _best_time(lambda v: _packed_linear(v, packed, None), x))
            ratios.append(fast / plain)
        decided[key] = math.prod(ratios) ** (1 / len(ratios)) < PACK_FLOAT32_MARGIN
    return decided[key]


def prepack_cpu_linears(model: nn.Module, float32: bool | None = None) -> int:
    """Replace plain CPU LoRALinears by PackedLoRALinears; returns how many.

    bf16 layers are packed where the CPU can (`cpu_can_prepack_bf16`) and the packed product
    equals F.linear's on a probe input (bitwise), so results never change. float32 layers of at
    least `PACK_FLOAT32_MIN_WEIGHTS` weights are packed where the product agrees within
    float32 rounding and, with `float32` None, where `packing_pays` on this CPU (timed once
    per distinct shape); True packs them without timing, False never. Nothing happens off
    the CPU or without oneDNN.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if type(mod) is LoRALinear
        and mod.weight.device.type == "cpu"
        and (
            (mod.weight.dtype == torch.bfloat16 and cpu_can_prepack_bf16())
            or (
                mod.weight.dtype == torch.float32
                and float32 is not False
                and mod.weight.numel() >= PACK_FLOAT32_MIN_WEIGHTS
            )
        )
    ]
    done = 0
    decided: dict = {}  # packing_pays' answers for this model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, mod in targets:
            w = mod.weight
            try:
                packed = PackedLoRALinear(mod, _pack(w))
                probe = torch.randn(3, mod.in_features, generator=gen).to(w.dtype)
                got, want = packed.base(probe), F.linear(probe, w, mod.bias)
            except RuntimeError:  # a oneDNN build without this dtype's support
                continue
            if w.dtype == torch.bfloat16:
                keep = torch.equal(got, want)
            else:
                keep = _close_to_f_linear(got, want)
                keep = keep and (float32 or packing_pays(w, packed.packed, decided))
            if keep:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, packed)
                done += 1
    return done


class PackedHead(nn.Module):
    """The lm_head ([vocab, hidden], no bias) kept in oneDNN's packed layout on the CPU.

    A vocabulary-sized GEMM is where a plain F.linear does worst, so packing pays most there,
    in float32 and in bf16 (more than at the layers' shapes: PackedLoRALinear; figures in
    docs/benchmarks.md). A tied head leaves the embedding its plain table (lookups
    need it), so packing it costs one more copy of the table; an untied head's plain weight
    is dropped. Use `prepack_cpu_lm_head`, which checks the packed product on a probe.
    """

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _packed_linear(x.reshape(-1, self.in_features), self.packed, None)
        return y.view(*x.shape[:-1], self.out_features)


# Heads narrower than this stay plain (test models); every vocabulary-sized head measured
# (8k-262k rows) ran faster packed at 16-64 rows.
PACK_HEAD_MIN_ROWS = 8192


def prepack_cpu_lm_head(model: nn.Module) -> bool:
    """Swap `model.lm_head` (an nn.Linear on the CPU) for a PackedHead; True if it did.

    bf16 must match F.linear bitwise on a probe (it does: both run oneDNN); float32 (MKL's
    GEMM unpacked, oneDNN's packed) must agree within float32 rounding (1e-5 of the largest
    logit). Otherwise, or on a CPU that cannot pack, the head stays as it was.
    """
    head = model.lm_head
    w = getattr(head, "weight", None)
    if (
        type(head) is not nn.Linear
        or head.bias is not None
        or w.device.type != "cpu"
        or w.shape[0] < PACK_HEAD_MIN_ROWS
        or not torch.backends.mkldnn.is_available()
        or w.dtype not in (torch.float32, torch.bfloat16)
        or (w.dtype == torch.bfloat16 and not cpu_can_prepack_bf16())
    ):
        return False
    with torch.no_grad():
        try:
            packed = PackedHead(_pack(w), w.shape[1], w.shape[0])
            probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
            probe = probe.to(w.dtype)
            got, want = packed(probe), F.linear(probe, w)
        except RuntimeError:
            return False
        if w.dtype == torch.bfloat16:
            same = torch.equal(got, want)
        else:
            same = _close_to_f_linear(got, want)
    if same:
        model.lm_head = packed
    return same
