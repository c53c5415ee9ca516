"""Fused per-layer ops, Triton: one launch each where the unfused layer launched several.

Semantics and shapes are `fused_reference.py`'s. The kernels round where the reference rounds
(each product and sum to the activations' dtype, the norm in float32), so on the GPU they
differ from it only by the hardware's rsqrt / exp and fused multiply-adds in float32.

    _add_rms_norm_kernel   one program per row: residual + x, store, RMSNorm, store
    _rope_kv_kernel        one program per token: every q and k head turned in place, k and v
                           rows stored into the paged cache at the token's slot
    _silu_mul_kernel       programs over (row, column tile) of the [T, I] output
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.fused_reference import rope_rows

__all__ = ["add_rms_norm", "rope_and_write_kv", "rope_rows", "silu_mul"]


def _pow2(n: int) -> int:
    # Not triton.next_power_of_2: a jit-callable, microseconds per call on the host.
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)  # rounded as residual + x
        tl.store(r_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if GEMMA:  # noqa: SIM108 (a constexpr branch)
        y = xf * inv * (1.0 + w)
    else:
        # x / rms(x) rounded to x's dtype first, then the product in the output's dtype.
        y = (xf * inv).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As fused_reference.add_rms_norm: x, residual [..., hidden] with a contiguous last dim
    (residual contiguous: it is updated in place); weight [hidden] contiguous."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.is_contiguous()
        r2 = residual.view(-1, hidden)
    else:
        r2 = x2
    out_dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block = _pow2(hidden)
        _add_rms_norm_kernel[(rows,)](
            x2, r2, weight, out, x2.stride(0), r2.stride(0), hidden, eps,
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, GEMMA=gemma,
            num_warps=min(max(block // 256, 1), 16),
        )  # fmt: skip
    return out, (x if residual is None else residual)


@triton.jit
def _rotate_heads(
    ptr, stride_h, c, s,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Load the rotating halves of HEADS heads and turn them; rounded as the reference:
    round(round(x1 c) - round(x2 s)), round(round(x2 c) + round(x1 s)). Returns (out1, out2,
    offsets, mask), [BLOCK_H, BLOCK_HALF] each."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < HEADS) & (i < HALF)
    offs = heads * stride_h + i
    x1 = tl.load(ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(ptr + offs + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * c).to(dt).to(tl.float32) - (x2f * s).to(dt).to(tl.float32)
    o2 = (x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt), offs, mask


@triton.jit
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, cs_ptr, pos_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, sin_off,
    stride_cslot, stride_chead,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    if GATHER:  # noqa: SIM108 (a constexpr branch)
        row = tl.load(pos_ptr + token).to(tl.int64)
    else:
        row = token
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    c = tl.load(cs_ptr + row * stride_cs + i, mask=i_ok, other=0.0)
    s = tl.load(cs_ptr + row * stride_cs + sin_off + i, mask=i_ok, other=0.0)
    dt = q_ptr.dtype.element_ty
    c = c.to(dt).to(tl.float32)[None, :]  # the reference rounds cos and sin to the dtype
    s = s.to(dt).to(tl.float32)[None, :]

    q_row = q_ptr + token * stride_qt
    o1, o2, offs, mask = _rotate_heads(q_row, stride_qh, c, s, Q_HEADS, BLOCK_QH, HALF,
                                       BLOCK_HALF)  # fmt: skip
    tl.store(q_row + offs, o1, mask=mask)
    tl.store(q_row + offs + HALF, o2, mask=mask)

    k_row = k_ptr + token * stride_kt
    o1, o2, offs, mask = _rotate_heads(k_row, stride_kh, c, s, KV_HEADS, BLOCK_KH, HALF,
                                       BLOCK_HALF)  # fmt: skip
    tl.store(k_row + offs, o1, mask=mask)
    tl.store(k_row + offs + HALF, o2, mask=mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # < 0: a padding token (a CUDA-graph batch padded to its bucket)
        heads = tl.arange(0, BLOCK_KH)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        dst = slot * stride_cslot + heads * stride_chead
        k_dst = k_cache_ptr + dst
        half_i = tl.arange(0, BLOCK_HALF)[None, :]
        tl.store(k_dst + half_i, o1, mask=mask)
        tl.store(k_dst + half_i + HALF, o2, mask=mask)
        # Features past the rotary dims pass unturned (partial rotary).
        pass_mask = (heads < KV_HEADS) & (d >= 2 * HALF) & (d < HEAD_DIM)
        kp = tl.load(k_row + heads * stride_kh + d, mask=pass_mask, other=0.0)
        tl.store(k_dst + d, kp, mask=pass_mask)
        v_mask = (heads < KV_HEADS) & (d < HEAD_DIM)
        vv = tl.load(v_ptr + token * stride_vt + heads * stride_vh + d, mask=v_mask, other=0.0)
        tl.store(v_cache_ptr + dst + d, vv, mask=v_mask)


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
    """As fused_reference.rope_and_write_kv, in one launch; slots < 0 are skipped (padding
    rows). q, k, v: last dim contiguous; caches contiguous (4-D or flat 3-D); cos_sin rows
    contiguous."""
    t, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == k.dtype
    assert cos_sin.stride(-1) == 1 and rotary_dim % 2 == 0 and rotary_dim <= head_dim
    if t == 0:
        return q, k
    half = rotary_dim // 2
    gather = positions is not None
    sin_off = half if gather else 2 * half  # table cos | sin, rows cos | -sin | sin
    _rope_kv_kernel[(t,)](
        q, k, v, cos_sin, positions if gather else slot_mapping, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0), sin_off, k_cache.stride(-3), k_cache.stride(-2),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_QH=_pow2(q_heads), BLOCK_KH=_pow2(kv_heads),
        BLOCK_HALF=_pow2(half), BLOCK_D=_pow2(head_dim),
        GATHER=gather,
    )  # fmt: skip
    return q, k


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, limit, alpha,
    INTER: tl.constexpr, BLOCK: tl.constexpr, CLAMPED: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    u = tl.load(x_ptr + row * stride_x + INTER + cols, mask=ok, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    uf = u.to(tl.float32)
    if CLAMPED:
        # Rounded to the dtype after each op, as the reference's separate torch ops.
        gf = tl.minimum(gf, limit).to(dt).to(tl.float32)
        uf = tl.minimum(tl.maximum(uf, -limit), limit).to(dt).to(tl.float32)
        sig = tl.sigmoid((gf * alpha).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        act = (gf * sig).to(dt).to(tl.float32)
        y = (uf + 1.0).to(dt).to(tl.float32) * act
    else:
        y = (gf * tl.sigmoid(gf)).to(dt).to(tl.float32) * uf  # silu rounds once, as torch's
    tl.store(out_ptr + row * stride_o + cols, y.to(dt), mask=ok)


def silu_mul(
    gate_up: torch.Tensor, limit: float | None = None, alpha: float = 1.702
) -> torch.Tensor:
    """As fused_reference.silu_mul, in one launch; gate_up's last dim contiguous."""
    inter = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * inter)
    assert x2.stride(-1) == 1
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    rows = x2.shape[0]
    if rows:
        block = min(_pow2(inter), 1024)
        _silu_mul_kernel[(rows, -(-inter // block))](
            x2, out, x2.stride(0), inter, 0.0 if limit is None else limit, alpha,
            INTER=inter, BLOCK=block, CLAMPED=limit is not None, num_warps=4,
        )  # fmt: skip
    return out
