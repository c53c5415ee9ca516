"""Fused per-layer ops, CPU form: `fused_reference.py`'s results, bit for bit, in as few torch
ops as give them.

The engine's CPU step is host-bound (each op's dispatch costs more than its arithmetic at
decode sizes), so these forms minimise ops per call rather than flops: torch.rms_norm for the
norm, in-place updates instead of fresh tensors, strided views instead of split/cat.
tests/kernels/test_fused.py checks each against the reference (equality, float32 / bf16 /
fp16) and counts their ops with torch.profiler against the unfused sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.fused_reference import rope_rows

__all__ = ["add_rms_norm", "rope_and_write_kv", "rope_rows", "silu_mul"]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float | torch.Tensor,
    gemma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As fused_reference.add_rms_norm (residual updated in place).

    `eps` as a float32 tensor [1, 1] (the engine's norms keep one): Llama style in float32
    runs in five ops instead of torch.rms_norm's two dozen (its composite, a scalar's
    conversion to a tensor among them): x * rsqrt(||x||^2 / n + eps) * w, with ||x|| from
    linalg.vector_norm. Equal to the reference within float32 rounding (the sum of squares
    taken as the square of its root), not bit for bit."""
    if residual is None:
        residual = x
    else:
        residual.add_(x)
    shape = (residual.shape[-1],)
    if isinstance(eps, torch.Tensor):
        if not gemma and residual.dtype == weight.dtype == torch.float32:
            n = torch.linalg.vector_norm(residual, 2, -1, keepdim=True)
            r = torch.addcmul(eps, n, n, value=1.0 / shape[0]).rsqrt_()
            return torch.mul(residual, r).mul_(weight), residual
        eps = float(eps)
    if gemma:
        f32 = torch.float32
        w = 1.0 + (weight if weight.dtype == f32 else weight.float())
        if residual.dtype == f32:
            return torch.rms_norm(residual, shape, w, eps), residual
        return torch.rms_norm(residual.float(), shape, w, eps).to(residual.dtype), residual
    if residual.dtype == torch.float32 and weight.dtype == torch.float32:
        # In float32 the weight inside rms_norm rounds as the reference's separate product.
        return torch.rms_norm(residual, shape, weight, eps), residual
    # Lower precision: rms_norm without a weight rounds x / rms(x) to the dtype once, as the
    # reference does before its product with the weight.
    normed = torch.rms_norm(residual, shape, None, eps)
    if weight.dtype == normed.dtype:
        return normed.mul_(weight), residual
    return weight * normed, residual


def _rotary_view(x: torch.Tensor, heads: int, half: int) -> torch.Tensor:
    """[T, heads, 2, half] view of the rotating features of x's heads (x [T, >=heads, D])."""
    return x.as_strided((x.shape[0], heads, 2, half), (x.stride(0), x.stride(1), half, 1))


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> bool:
    """k's heads directly follow q's in one storage (views of one qkv projection): then one
    strided view covers both and they rotate together."""
    return (
        q.dtype == k.dtype
        and (q.shape[0] == 1 or q.stride(0) == k.stride(0))  # a 1-row stride means nothing
        and q.stride(1) == k.stride(1) == q.shape[2]
        and q.stride(2) == k.stride(2) == 1
        and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size()
        and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    )


def _rotate_(x4: torch.Tensor, cos: torch.Tensor, sin_pm: torch.Tensor) -> None:
    """x4 [T, H, 2, half] := x4 * cos + swap_halves(x4) * (-sin, sin), in place. Each product
    and the sum round to the dtype as the reference's x * cos + cat(-x2, x1) * sin does (the
    sign moves from x2 to sin, exactly)."""
    a = x4 * cos
    # flip is one aten op; roll(1, 2) swaps the halves about four times faster here but as
    # eleven ops (narrows and a cat): each op is host work per layer (docs/step-overhead.md).
    # index_select(2, (1, 0)) is faster than flip from 16 rows up, but nests two aten ops
    # more, and a step's ops count too (figures: docs/cpu-path.md)
    b = x4.flip(2).mul_(sin_pm)
    torch.add(a, b, out=x4)


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
    """As fused_reference.rope_and_write_kv. Fewest ops when the caller passes `rope_rows`
    already in q's dtype (positions None), flat caches, and q, k as views of one qkv row."""
    half = rotary_dim // 2
    rows = cos_sin if positions is None else rope_rows(cos_sin, positions, q.dtype)
    if rows.dtype != q.dtype:
        rows = rows.to(q.dtype)
    t = rows.shape[0]
    width = rows.stride(0)
    # cos broadcast over both halves; (-sin, sin) for (first, second) half: strided views
    # of the rows cos | -sin | sin, no copies.
    cos = rows.as_strided((t, 1, 2, half), (width, 0, 0, 1))
    sin_pm = rows.as_strided((t, 1, 2, half), (width, 0, half, 1), rows.storage_offset() + half)
    if _adjacent(q, k):
        _rotate_(_rotary_view(q, q.shape[1] + k.shape[1], half), cos, sin_pm)
    else:
        _rotate_(_rotary_view(q, q.shape[1], half), cos, sin_pm)
        _rotate_(_rotary_view(k, k.shape[1], half), cos, sin_pm)
    if k_cache.dim() == 4:
        k_cache = k_cache.view(-1, *k_cache.shape[2:])
        v_cache = v_cache.view(-1, *v_cache.shape[2:])
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)
    return q, k


def silu_mul(
    gate_up: torch.Tensor, limit: float | None = None, alpha: float = 1.702
) -> torch.Tensor:
    """As fused_reference.silu_mul; the result is computed in the first fresh tensor (no
    intermediates beyond it). gate_up is not changed."""
    if limit is None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        # the halves as two strided views (one op each; chunk takes eight)
        (t, width), stride = gate_up.shape, gate_up.stride(0)
        half = width // 2
        gate = gate_up.as_strided((t, half), (stride, 1))
        up = gate_up.as_strided((t, half), (stride, 1), gate_up.storage_offset() + half)
        return F.silu(gate).mul_(up)
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is None:
        return F.silu(gate).mul_(up)
    g = gate.clamp(max=limit)
    s = torch.mul(g, alpha).sigmoid_().mul_(g)
    return up.clamp(min=-limit, max=limit).add_(1).mul_(s)
