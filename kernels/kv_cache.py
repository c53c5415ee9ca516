"""Scatter each new token's K and V into the paged KV cache (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_rows(x, scale_ptr, mask, KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] -> int8 rows; stores each head's float16 scale (as
    reference.quantize_kv)."""
    x = tl.where(mask, x.to(tl.float32), 0.0)
    scale = (tl.max(tl.abs(x), 1) / 127.0).to(tl.float16)  # [BLOCK_H]
    heads = tl.arange(0, BLOCK_H)
    tl.store(scale_ptr + heads, scale, mask=heads < KV_HEADS)
    s = scale.to(tl.float32)
    s = tl.where(s == 0.0, 1.0, s)
    q = tl.floor(x / s[:, None] + 0.5)
    return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_ss,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr = False,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token (e.g. a CUDA-graph batch padded to a fixed size)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
    src = token.to(tl.int64)
    dst = slot * stride_cs + heads * stride_ch + dims
    k = tl.load(k_ptr + src * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + src * stride_vt + heads * stride_vh + dims, mask=mask)
    if QUANT:
        k = _quantize_rows(k, k_scale_ptr + slot * stride_ss, mask, KV_HEADS, BLOCK_H)
        v = _quantize_rows(v, v_scale_ptr + slot * stride_ss, mask, KV_HEADS, BLOCK_H)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Semantics: cache.flat[slot_mapping[t]] = kv[t]; slots < 0 are skipped; caches changed
    in place. With scales (int8 caches): cache.flat[slot], scale.flat[slot] =
    reference.quantize_kv(kv[t]).

    Shape: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] (contiguous);
    k, v [num_tokens, kv_heads, head_dim] (last dim contiguous); slot_mapping [num_tokens];
    k_scale, v_scale [num_blocks, block_size, kv_heads] float16 (contiguous) or None.
    """
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(2) == 1 and v.stride(2) == 1
    quant = k_scale is not None
    assert quant == (k_cache.dtype == torch.int8) == (v_scale is not None)
    assert not quant or (k_scale.is_contiguous() and v_scale.is_contiguous())
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if quant else k_cache, v_scale if quant else v_cache,  # not read without
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        kv_heads,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=quant,
    )  # fmt: skip
