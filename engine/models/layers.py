"""Building blocks of the decoder: norms, rotary embedding, LoRA-aware fused linears, attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# the step's metadata the layers read (built before the forward by engine/step/step_plan.py)
from loraplex.engine.forward_context import ForwardContext, LoRABatch
from loraplex.engine.models.spec import ModelSpec, RopeSpec
from loraplex.kernels.dispatch import UsesBackend


class RMSNorm(nn.Module):
    """Llama style (`w * norm(x)`), or Gemma style (`(1 + w) * norm(x)` computed in fp32)."""

    def __init__(self, dim: int, eps: float, gemma: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.gemma = gemma
        # eps as a float32 [1, 1] tensor (DecoderLM.build_buffers), for the CPU's fused norm
        self.eps_tensor: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def inv_frequencies(rope: RopeSpec, dim: int) -> torch.Tensor:
    """The [dim / 2] rotation frequencies of the `dim` rotating features of a head."""
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv = 1.0 / base
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
    elif rope.kind == "longrope":
        # Only the short factors: transformers uses them up to the original context, the
        # longest the loader allows (see engine/weights/loader.py).
        inv = 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * base)
    elif rope.kind == "yarn":
        # Features that turn fewer than beta_slow times over the original context are
        # interpolated (inv / factor), more than beta_fast times kept, a linear ramp between.
        def dim_of(rotations: float) -> float:
            turns = rope.original_max_position / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(rope.theta))

        low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers does, against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # weight of the original frequency
        inv = (1.0 / (rope.factor * base)) * (1 - keep) + inv * keep
    return inv


class Rotary(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table over all positions; with a partial
    rotary factor only the first `rotary_dim` features of a head turn, the rest pass."""

    def __init__(self, rope: RopeSpec, head_dim: int):
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.rotary_dim = rope.rotary_dim(head_dim)
        self.cos_sin = torch.empty(0)
        self.key: tuple = ()  # names the table among the model's (build)

    def build(self, device: torch.device, max_len: int, shared: dict) -> None:
        """Tables are shared between layers with the same RoPE and sized to max_len."""
        key = (self.rope, self.head_dim, max_len)
        self.key = key
        if key not in shared:
            inv = inv_frequencies(self.rope, self.rotary_dim).to(device)
            t = torch.arange(max_len, device=device, dtype=torch.float32)
            freqs = torch.outer(t, inv)  # [max_len, rotary_dim / 2]
            table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
            if self.rope.attention_factor != 1.0:  # YaRN: in float32, as transformers scales
                table = table * self.rope.attention_factor
            shared[key] = table
        self.cos_sin = shared[key]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin at `positions`, [num_tokens, 1, rotary_dim] in dtype."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return torch.cat([cos, cos], -1).to(dtype), torch.cat([sin, sin], -1).to(dtype)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: dict | None = None
    ) -> torch.Tensor:
        """x [num_tokens, heads, head_dim]. `rope`: the step's looked-up rows per table
        (ForwardContext.rope); without this table's there, looked up for this call."""
        planned = rope.get(self.key) if rope else None
        cos, sin = planned if planned is not None else self.tables(positions, x.dtype)
        if self.rotary_dim < self.head_dim:
            rot, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
            return torch.cat([self._rotate(rot, cos, sin), rest], dim=-1)
        return self._rotate(x, cos, sin)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LoRALinear(UsesBackend, nn.Module):
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
        self.lora_a: torch.Tensor | None = None  # [num_slots, max_width, in] (see below)
        self.lora_b: torch.Tensor | None = None  # [num_slots, max_width, out]
        self.lora_widths: list[int] = []  # per slot; 0 = this module not targeted
        # DoRA: [num_slots + 1, out] factor per output row (ones: no DoRA; the last row is
        # slot -1's), (1 - factor) * bias when there is a bias, and the slots with DoRA here
        self.lora_dora: torch.Tensor | None = None
        self.lora_dora_shift: torch.Tensor | None = None
        self.lora_dora_on: set[int] = set()
        self._weight_t: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight, its W^T)

    @property
    def lora_a(self) -> torch.Tensor | None:
        return self._lora_a

    @lora_a.setter
    def lora_a(self, stack: torch.Tensor | None) -> None:
        """The A stack, and beside it its [num_slots, in, max_width] transposed view, which
        the CPU's batched shrink multiplies by, and that view's slot by slot, which a group
        of rows on one adapter multiplies by (made once here, not per call)."""
        self._lora_a = stack
        self.lora_a_t = None if stack is None else stack.mT
        self.lora_a_t_slots = None if stack is None else self.lora_a_t.unbind(0)

    @property
    def lora_b(self) -> torch.Tensor | None:
        return self._lora_b

    @lora_b.setter
    def lora_b(self, stack: torch.Tensor | None) -> None:
        """The B stack, and its slots' views (as lora_a's)."""
        self._lora_b = stack
        self.lora_b_slots = None if stack is None else stack.unbind(0)

    def _take_over(self, lin: LoRALinear) -> None:
        """For subclasses that replace a loaded `lin` and keep its base weight their own way
        (packed, quantized): its shape, bias and LoRA slots; the float weight is dropped."""
        nn.Module.__init__(self)  # LoRALinear's own init would allocate a float weight
        self.out_sizes = lin.out_sizes
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.bias = lin.bias
        self.lora_a, self.lora_b, self.lora_widths = lin.lora_a, lin.lora_b, lin.lora_widths
        self.lora_dora, self.lora_dora_shift = lin.lora_dora, lin.lora_dora_shift
        self.lora_dora_on = lin.lora_dora_on
        self._bound = lin._bound
        self._weight_t = None
        self.weight = None  # only `base` multiplies
        # ||W_n||^2 per output row, for DoRA's norms where no float weight stays (`base_probe`)
        # (a checkpoint already quantized leaves a placeholder, not a [out, in] weight: its
        # subclass dequantizes for DoRA instead)
        w = lin.weight
        full = w is not None and w.dim() == 2 and w.shape == (self.out_features, self.in_features)
        self.weight_sq = w.detach().float().pow(2).sum(1) if full else None

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """The base layer alone; quantized subclasses (engine/weights/quantization.py) replace
        it."""
        w = self.weight
        if x.dim() != 2:
            return F.linear(x, w, self.bias)
        # x W^T as one mm against a transposed view kept beside the weight (the same BLAS
        # call F.linear makes, without its per-call transpose and matmul dispatch); the view
        # is remade when the weight is replaced (loading, quantization)
        if self._weight_t is None or self._weight_t[0] is not w:
            self._weight_t = (w, w.detach().t())
        wt = self._weight_t[1]
        return torch.mm(x, wt) if self.bias is None else torch.addmm(self.bias, x, wt)

    def base_weight(self) -> torch.Tensor | None:
        """The float32 [out, in] weight `base` multiplies by (DoRA's norms are taken of it);
        quantized subclasses dequantize. None where only a packed form stays: see base_probe."""
        return None if self.weight is None else self.weight.detach().float()

    @torch.no_grad()  # autograd through oneDNN's product with a grad-requiring bias is slow
    def base_probe(self, a: torch.Tensor) -> torch.Tensor:
        """W a^T, float32 [out, r], for a [r, in], through `base` itself (a packed layer keeps
        no float weight): with `weight_sq` what DoRA's row norms of W + B A need."""
        dtype = a.dtype if self.lora_a is None else self.lora_a.dtype  # the activations'
        y = self.base(a.to(dtype))
        return (y if self.bias is None else y - self.bias).float().T

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        y = self.base(x)  # [num_tokens, out]
        if lora is not None and self.lora_a is not None and lora.static:
            self.backend.lora_apply_static(y, x, self.lora_a, self.lora_b, lora.row_slots)
        elif lora is not None and self.lora_a is not None:
            plan = lora.plans.get(tuple(self.lora_widths))
            views = (self.lora_a_t_slots, self.lora_b_slots)
            self.backend.lora_apply(y, x, self.lora_a, self.lora_b, lora.segments,
                                    self.lora_widths, plan=plan, lora_a_t=self.lora_a_t,
                                    slot_views=views)  # fmt: skip
        d = None if lora is None else lora.dora
        if (
            d is not None
            and self.lora_dora is not None
            and (lora.static or not self.lora_dora_on.isdisjoint(d.on))
        ):
            self.backend.dora_apply(y, self.lora_dora, self.lora_dora_shift, d.slots, d.rows)
        return y


def kv_bound(cache_dtype: torch.dtype, dtype: torch.dtype) -> float:
    """The largest |value| a key or value carries into the KV cache (NaN becomes 0).

    Other rows read a row's cache slots, masked out, whenever they gather the same blocks (a
    block freed and handed to another sequence, a short sequence's padding in a batched
    decode): a masked weight is an exact 0, but 0 x NaN is NaN, and an infinite score q k^T
    plus an additive -inf mask is NaN too. Only a row already ruined (an adapter of absurd
    magnitude) reaches the bound, and what is kept stays finite through what follows the
    clamp: RoPE (up to x sqrt 2), an int8 cache's Hadamard rotation (up to x sqrt head_dim)
    and float16 scale (max|x| / 127 <= 65504), and another row's q k^T over head_dim terms.
    Real keys and values are orders of magnitude below each bound."""
    if cache_dtype == torch.int8:
        return 2.0**18
    if dtype == torch.float16:
        return 2.0**14
    return 2.0**64


class Attention(UsesBackend, nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.spec = spec
        self.qkv_proj = LoRALinear(
            spec.hidden_size, [spec.q_size, spec.kv_size, spec.kv_size], spec.qkv_bias
        )
        self.o_proj = LoRALinear(spec.q_size, [spec.hidden_size], spec.o_bias)
        self.qk_norm = spec.gemma or spec.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, gemma=spec.gemma)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, gemma=spec.gemma)
        self.rotary = Rotary(spec.ropes[layer], spec.head_dim)
        self.window = spec.windows[layer]
        # gpt-oss: a learned logit per head that takes part in the softmax and attends to nothing
        self.sinks = nn.Parameter(torch.empty(spec.num_heads)) if spec.attention_sinks else None
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        # int8 caches only: [num_blocks, block_size, kv_heads] float16, and the rotation
        # [head_dim, head_dim] float32 applied to q, k, v (engine/memory/kv_cache.py)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.kv_rotation: torch.Tensor | None = None
        # (k_cache, its flat view, v_cache's flat view): remade when the caches are replaced
        self._flat_caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        s = self.spec
        qkv = self.qkv_proj(x, ctx.lora)
        if ctx.lora is not None:  # only an adapter can ruin a row: bound k, v (see kv_bound)
            self._bound_kv(qkv)
        rows = ctx.rope_rows.get(self.rotary.key)
        if rows is not None and self.kv_rotation is None and self.k_scale is None:
            return self._forward_fused(qkv, rows, ctx)
        q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = q.unflatten(-1, (s.num_heads, s.head_dim))  # [num_tokens, heads, head_dim]
        k = k.unflatten(-1, (s.num_kv_heads, s.head_dim))
        v = v.unflatten(-1, (s.num_kv_heads, s.head_dim))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, positions, ctx.rope), self.rotary(k, positions, ctx.rope)
        a = ctx.attn
        rot = self.kv_rotation
        if rot is not None:  # an orthogonal R: (qR)(kR)^T = q k^T, and p (vR) R^T = p v
            q, k, v = (q.float() @ rot).to(q.dtype), k.float() @ rot, v.float() @ rot
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        self.backend.write_kv_cache(self.k_cache, self.v_cache, k, v, a.slot_mapping, **scales)
        out = torch.empty_like(q)
        if ctx.static is not None:
            self.backend.decode_attention_static(
                out, q, self.k_cache, self.v_cache, ctx.static.block_tables,
                ctx.static.seq_lens, s.query_scale, self.window, s.attn_softcap, **scales,
                sinks=None if self.sinks is None else self.sinks.float(),
            )  # fmt: skip
            if rot is not None:
                out = (out.float() @ rot.T).to(x.dtype)
            return self.o_proj(out.flatten(-2), ctx.lora)
        self.backend.paged_attention(
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
            plan=a.plan,
            sinks=None if self.sinks is None else self.sinks.float(),
        )
        if rot is not None:
            out = (out.float() @ rot.T).to(x.dtype)
        return self.o_proj(out.flatten(-2), ctx.lora)

    def _bound_kv(self, qkv: torch.Tensor) -> None:
        """NaN -> 0 and every value into +-kv_bound, in place, over the whole projection (q is
        the row's own, and one op over all of it is cheaper than views of k and v). Python
        float bounds: clamp_ with 0-dim tensor bounds takes a slower, broadcasting path."""
        b = kv_bound(self.k_cache.dtype, qkv.dtype)
        torch.nan_to_num_(qkv, 0.0).clamp_(-b, b)

    def _forward_fused(self, qkv: torch.Tensor, rows: torch.Tensor, ctx: ForwardContext):
        """A float KV cache and no rotation: q, k and v stay views of the projection, RoPE
        turns q and k in place and writes k and v to the cache in one fused op."""
        s = self.spec
        q, k, v = _heads(qkv, s.head_dim, (s.num_heads, s.num_kv_heads, s.num_kv_heads))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        a = ctx.attn
        if self._flat_caches is None or self._flat_caches[0] is not self.k_cache:
            flat = (-1, *self.k_cache.shape[2:])  # [slots, kv_heads, head_dim] views, kept
            self._flat_caches = (self.k_cache, self.k_cache.view(flat), self.v_cache.view(flat))
        _, k_flat, v_flat = self._flat_caches
        self.backend.rope_and_write_kv(q, k, v, rows, self.rotary.rotary_dim, k_flat, v_flat,
                                       a.slot_mapping)  # fmt: skip
        # no `out` given: the backend returns its result where its kernel wrote it (no copy)
        out = self.backend.paged_attention(
            None, q, self.k_cache, self.v_cache, a.block_tables, a.query_start_loc, a.seq_lens,
            s.query_scale, self.window, s.attn_softcap, plan=a.plan,
            sinks=None if self.sinks is None else self.sinks.float(),
        )  # fmt: skip
        return self.o_proj(out.view(out.shape[0], -1), ctx.lora)


def _heads(qkv: torch.Tensor, head_dim: int, heads: tuple[int, ...]) -> list[torch.Tensor]:
    """q, k, v as [tokens, heads, head_dim] strided views of a [tokens, sum * head_dim]
    projection (one op each, where view + split take five)."""
    t, stride, off = qkv.shape[0], qkv.stride(0), qkv.storage_offset()
    out = []
    for n in heads:
        out.append(qkv.as_strided((t, n, head_dim), (stride, head_dim, 1), off))
        off += n * head_dim
    return out


class MLP(UsesBackend, nn.Module):
    def __init__(self, spec: ModelSpec, intermediate_size: int | None = None):
        super().__init__()
        i = intermediate_size or spec.intermediate_size
        self.gate_up_proj = LoRALinear(spec.hidden_size, [i, i], spec.mlp_bias)
        self.down_proj = LoRALinear(i, [spec.hidden_size], spec.mlp_bias)
        self.silu = spec.activation == "silu"

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if self.silu:
            return self.down_proj(self.backend.silu_mul(gate_up), lora)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, lora)
