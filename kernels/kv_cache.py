"""Scatter each new token's K and V into the paged KV cache (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + src * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Semantics: cache.flat[slot_mapping[t]] = kv[t]; slots < 0 are skipped; caches changed
    in place.

    Shape: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] (contiguous);
    k, v [num_tokens, kv_heads, head_dim] (last dim contiguous); slot_mapping [num_tokens].
    """
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(2) == 1 and v.stride(2) == 1
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
