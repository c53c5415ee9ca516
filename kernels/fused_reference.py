"""Fused per-layer ops, torch reference: the semantics (and the oracle) of `fused.py`'s Triton
kernels and `fused_cpu.py`'s CPU forms.

Each op does what a few separate ops of a decoder layer did before, and rounds exactly where
they did (engine/models/layers.py: RMSNorm, Rotary, the MLP and gpt-oss activations), so
fusing changes no result on the CPU. Written for clarity, not speed.

    add_rms_norm       residual += x; RMSNorm(residual)            (Llama or Gemma style)
    rope_rows          a step's cos/sin rows, gathered once for every layer
    rope_and_write_kv  rotate-half RoPE of q and k in place; k, v into the paged caches
    silu_mul           SiLU(gate) * up of a fused gate|up projection (or gpt-oss's clamped form)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """RMSNorm along the last dim, rounded as engine/models/layers.py RMSNorm.

    Llama style: weight * (x / rms(x) in float32, rounded to x's dtype), the product in the
    promoted dtype of weight and x. Gemma style: (1 + weight) * x / rms(x) all in float32,
    rounded once to x's dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: the seam between two sublayers of a pre-norm decoder.

    Semantics: residual += x (in place, in residual's dtype; the same sum as `residual + x`);
    returns (rms_norm(residual, weight, eps, gemma), residual). With residual None (the first
    layer) nothing is added: returns (rms_norm(x, ...), x).

    Shape: x, residual [..., hidden] (same shape and dtype; residual writable);
    weight [hidden]. normed has x's shape; its dtype as `rms_norm`.
    """
    if residual is None:
        return rms_norm(x, weight, eps, gemma), x
    residual.copy_(residual + x)
    return rms_norm(residual, weight, eps, gemma), residual


def rope_rows(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A step's rotation rows, gathered once and shared by every layer using the same table.

    Semantics: with cos, sin = cos_sin[positions].chunk(2, -1) (each [T, rotary_dim / 2],
    rounded to dtype): rows = cat(cos, -sin, sin). `rope_and_write_kv` takes them in place of
    the table when its `positions` is None.

    Shape: cos_sin [max_len, rotary_dim] float32 (engine/models/layers.py Rotary's table:
    cat(cos, sin) of the half frequencies); positions [T] int64. Returns [T, 3 * rotary_dim / 2]
    in dtype.
    """
    cos, sin = cos_sin[positions].to(dtype).chunk(2, dim=-1)
    return torch.cat([cos, -sin, sin], dim=-1)


def _cos_sin(table, positions, rotary_dim, dtype):
    """cos, sin [T, rotary_dim / 2] in dtype from the table (positions given) or from rows."""
    half = rotary_dim // 2
    if positions is None:
        return table[:, :half].to(dtype), table[:, 2 * half : 3 * half].to(dtype)
    cos, sin = table[positions].chunk(2, dim=-1)
    return cos.to(dtype), sin.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate-half RoPE of the first rotary_dim features of each head, as engine Rotary:
    x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin), every product and the sum rounded to x's
    dtype; the other features pass. x [T, heads, head_dim]; cos, sin [T, rotary_dim / 2]."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos = torch.cat([cos, cos], -1).unsqueeze(1)
    sin = torch.cat([sin, sin], -1).unsqueeze(1)
    return torch.cat([rot * cos + torch.cat([-x2, x1], dim=-1) * sin, rest], dim=-1)


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor | None,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q and k, then k and v into the paged KV cache (float caches).

    Semantics: q and k rotated in place (`rope`, the cos/sin of token t at positions[t]);
    cache.flat[slot_mapping[t]] = k[t] (rotated), v[t] (as reference.write_kv_cache); returns
    (q, k), the same tensors. With positions None, cos_sin holds `rope_rows` (row t for token t)
    instead of the table.

    Shape: q [T, heads, head_dim], k, v [T, kv_heads, head_dim] (last dim contiguous; views of
    one qkv projection are fine); cos_sin [max_len, rotary_dim] float32 or rows
    [T, 3 * rotary_dim / 2]; positions [T] int64 or None; rotary_dim even, <= head_dim;
    k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] in k's dtype, or already
    flat [num_blocks * block_size, kv_heads, head_dim]; slot_mapping [T] int64, each >= 0.
    """
    cos, sin = _cos_sin(cos_sin, positions, rotary_dim, q.dtype)
    q.copy_(rope(q, cos, sin, rotary_dim))
    k.copy_(rope(k, cos, sin, rotary_dim))
    for cache, x in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, *cache.shape[-2:])
        flat.index_copy_(0, slot_mapping, x)
    return q, k


def silu_mul(
    gate_up: torch.Tensor, limit: float | None = None, alpha: float = 1.702
) -> torch.Tensor:
    """The gated activation of a fused gate|up projection.

    Semantics: gate, up = gate_up.chunk(2, -1); SiLU(gate) * up, or with `limit` (gpt-oss):
    gate = gate.clamp(max=limit), up = up.clamp(-limit, limit),
    (up + 1) * (gate * sigmoid(gate * alpha)); every op rounded to gate_up's dtype, as
    engine/models/layers.py MLP and engine/models/moe.py compute it.

    Shape: gate_up [..., 2 * I]. Returns [..., I] in gate_up's dtype.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
