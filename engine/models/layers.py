"""Building blocks of the decoder: norms, rotary embedding, LoRA-aware fused linears, attention."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.models.spec import ModelSpec, RopeSpec
from loraplex.kernels import dispatch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: KV slot of each new token
    query_start_loc: list[int]  # num_seqs + 1: row range of each sequence's new tokens
    seq_lens: list[int]  # num_seqs: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0


@dataclass
class LoRABatch:
    """Rows grouped by adapter slot: (start_row, end_row, slot), slot -1 = no adapter."""

    segments: list[tuple[int, int, int]]


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    lora: LoRABatch | None  # None when no row has an adapter
    # What the layers of one forward pass share (e.g. each RoPE table's rows for its
    # positions); a new context per pass, so nothing outlives the step's positions.
    memo: dict = field(default_factory=dict)


class RMSNorm(nn.Module):
    """Llama style (`w * norm(x)`), or Gemma style (`(1 + w) * norm(x)` computed in fp32)."""

    def __init__(self, dim: int, eps: float, gemma: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def inv_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    inv = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        mid = (1 - smooth) * inv / rope.factor + smooth * inv
        inv = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        inv = torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), mid, inv)
    return inv


class Rotary(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table over all positions."""

    def __init__(self, rope: RopeSpec, head_dim: int):
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.cos_sin = torch.empty(0)

    def build(self, device: torch.device, max_len: int, shared: dict) -> None:
        """Tables are shared between layers with the same RoPE and sized to max_len."""
        key = (self.rope, self.head_dim, max_len)
        if key not in shared:
            inv = inv_frequencies(self.rope, self.head_dim).to(device)
            t = torch.arange(max_len, device=device, dtype=torch.float32)
            freqs = torch.outer(t, inv)  # [max_len, head_dim / 2]
            shared[key] = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.cos_sin = shared[key]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin at `positions`, full head width, [num_tokens, 1, head_dim] in dtype."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return torch.cat([cos, cos], -1).to(dtype), torch.cat([sin, sin], -1).to(dtype)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, memo: dict | None = None
    ) -> torch.Tensor:
        """x [num_tokens, heads, head_dim]. With `memo` (one forward pass's), the layers and
        q/k calls that share this table look its rows up once: Gemma 3 270M, 36 calls per
        step over 2 tables, 4.5 -> 2.6 ms per decode step at 32 rows (bf16, Zen 4 EPYC)."""
        if memo is None:
            cos, sin = self.tables(positions, x.dtype)
        else:
            # The value holds the table and positions, so their ids stay theirs meanwhile.
            key = ("rope", id(self.cos_sin), id(positions), x.dtype)
            if key not in memo:
                memo[key] = (self.cos_sin, positions, *self.tables(positions, x.dtype))
            cos, sin = memo[key][2:]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LoRALinear(nn.Module):
    """A linear layer whose output is several fused slices (e.g. q|k|v), each a LoRA target.

    The adapter manager installs per-slot stacked weights (`lora_a`, `lora_b`, `lora_widths`;
    layout in kernels/reference.py); each step's `LoRABatch` says which rows use which slot.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool):
        super().__init__()
        self.out_sizes = out_sizes
        self.in_features, self.out_features = in_features, sum(out_sizes)
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(out_sizes))) if bias else None
        self.lora_a: torch.Tensor | None = None  # [num_slots, max_width, in]
        self.lora_b: torch.Tensor | None = None  # [num_slots, max_width, out]
        self.lora_widths: list[int] = []  # per slot; 0 = this module not targeted

    def _take_over(self, lin: LoRALinear) -> None:
        """For subclasses that replace a loaded `lin` and keep its base weight their own way
        (packed, quantized): its shape, bias and LoRA slots; the float weight is dropped."""
        nn.Module.__init__(self)  # LoRALinear's own init would allocate a float weight
        self.out_sizes = lin.out_sizes
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.bias = lin.bias
        self.lora_a, self.lora_b, self.lora_widths = lin.lora_a, lin.lora_b, lin.lora_widths
        self.weight = None  # only `base` multiplies

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """The base layer alone; quantized subclasses (engine/quantization.py) replace it."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        y = self.base(x)  # [num_tokens, out]
        if lora is not None and self.lora_a is not None:
            dispatch.lora_apply(y, x, self.lora_a, self.lora_b, lora.segments, self.lora_widths)
        return y


class PackedLoRALinear(LoRALinear):
    """A LoRALinear on the CPU whose base weight is stored pre-packed in oneDNN's blocked
    layout, built from a loaded LoRALinear that it then replaces (the plain weight is dropped).

    `F.linear` re-packs a bf16 weight on every call; packing once gives bitwise the same
    results and saves that work: on a 2-core AMD EPYC, bf16, 1 thread, [37, 640] x [640, 4096]
    0.73 -> 0.60 ms, one row 0.22 -> 0.11 ms; the demo model's decode step at batch 32
    129 -> 121 ms. In float32, F.linear runs MKL's GEMM and the packed form oneDNN's (equal
    within float32 rounding), which is faster at decode-sized rows on some CPUs: a 2-core Zen 3
    EPYC (AVX2), 1 thread, [32, 640] x [640, 4096] 33 -> 42 GFLOP/s, the demo model served
    in-process 53 -> 59.5 tok/s at 32 sequences. Use `prepack_cpu_linears`, which decides per
    layer.
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


# Decided once per (out, in) shape and thread count for the process, so every engine in it
# computes alike.
_PACKING_PAYS: dict[tuple[int, int, int], bool] = {}


def packing_pays(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN's packed float32 product beats F.linear on this CPU for this shape,
    timed at `PACK_TIMING_ROWS` (interleaved, best of several runs; about 0.2 s for the demo
    model's largest layer)."""
    key = (*weight.shape, torch.get_num_threads())
    if key not in _PACKING_PAYS:
        gen = torch.Generator().manual_seed(0)
        ratios = []
        for rows in PACK_TIMING_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=gen)
            plain, fast = float("inf"), float("inf")
            for _ in range(2):
                plain = min(plain, _best_time(lambda v: F.linear(v, weight), x))
                fast = min(fast, _best_time(lambda v: _packed_linear(v, packed, None), x))
            ratios.append(fast / plain)
        _PACKING_PAYS[key] = math.prod(ratios) ** (1 / len(ratios)) < PACK_FLOAT32_MARGIN
    return _PACKING_PAYS[key]


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
                keep = keep and (float32 or packing_pays(w, packed.packed))
            if keep:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, packed)
                done += 1
    return done


class PackedHead(nn.Module):
    """The lm_head ([vocab, hidden], no bias) kept in oneDNN's packed layout on the CPU.

    A vocabulary-sized GEMM is where a plain F.linear does worst: float32 on a 2-core AVX2
    EPYC, 1 thread, the demo model's [262144, 640] head: 8 rows 151 -> 79 ms, 32 rows 296 ->
    195 ms, 64 rows 509 -> 348 ms (the layers' shapes gain less: PackedLoRALinear); bf16 with
    AVX-512, 37 rows 60 -> 45 ms. A tied head leaves the embedding its plain table (lookups
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


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.spec = spec
        self.qkv_proj = LoRALinear(
            spec.hidden_size, [spec.q_size, spec.kv_size, spec.kv_size], spec.qkv_bias
        )
        self.o_proj = LoRALinear(spec.q_size, [spec.hidden_size], spec.o_bias)
        if spec.gemma:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, gemma=True)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, gemma=True)
        self.rotary = Rotary(spec.ropes[layer], spec.head_dim)
        self.window = spec.windows[layer]
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        # int8 caches only: [num_blocks, block_size, kv_heads] float16, and the rotation
        # [head_dim, head_dim] float32 applied to q, k, v (engine/kv_cache.py)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.kv_rotation: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        s = self.spec
        qkv = self.qkv_proj(x, ctx.lora)
        q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = q.unflatten(-1, (s.num_heads, s.head_dim))  # [num_tokens, heads, head_dim]
        k = k.unflatten(-1, (s.num_kv_heads, s.head_dim))
        v = v.unflatten(-1, (s.num_kv_heads, s.head_dim))
        if s.gemma:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, positions, ctx.memo), self.rotary(k, positions, ctx.memo)
        a = ctx.attn
        rot = self.kv_rotation
        if rot is not None:  # an orthogonal R: (qR)(kR)^T = q k^T, and p (vR) R^T = p v
            q, k, v = (q.float() @ rot).to(q.dtype), k.float() @ rot, v.float() @ rot
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        dispatch.write_kv_cache(self.k_cache, self.v_cache, k, v, a.slot_mapping, **scales)
        out = torch.empty_like(q)
        dispatch.paged_attention(
            out,
            q,
            self.k_cache,
            self.v_cache,
            a.block_tables,
            a.query_start_loc,
            a.seq_lens,
            s.query_scale,
            self.window,
            s.attn_softcap,
            **scales,
        )
        if rot is not None:
            out = (out.float() @ rot.T).to(x.dtype)
        return self.o_proj(out.flatten(-2), ctx.lora)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        i = spec.intermediate_size
        self.gate_up_proj = LoRALinear(spec.hidden_size, [i, i], spec.mlp_bias)
        self.down_proj = LoRALinear(i, [spec.hidden_size], spec.mlp_bias)
        self.act = (
            F.silu if spec.activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
        )

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, lora).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, lora)
