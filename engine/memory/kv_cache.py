"""The paged KV cache's storage: its element type, bytes per block, allocation per layer.

    kv_cache_dtype "auto": k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] in
                           the model's dtype
    kv_cache_dtype "int8": the same caches in int8, and k_scale, v_scale
                           [num_blocks, block_size, kv_heads] float16, one symmetric scale
                           per token per head (kernels.reference.quantize_kv):

        one token, one head:   | q_0 q_1 ... q_{d-1} (int8) |  + scale (float16, 2 bytes)
        bytes per token-head:  d + 2   (bf16 cache: 2 d;  head_dim 64: 1.94x the tokens)

With int8, q, k and v are rotated by the normalised Hadamard matrix R of head_dim (a power
of two; attention is unchanged: (qR)(kR)^T = q k^T, and the output is turned back by R^T):
the rotation spreads the few large channels of the keys over all of them, so one scale per
row fits every value better. On the demo model it halved the int8 round-trip error of keys
(1.5 % -> 0.66 % relative) and values (1.2 % -> 0.68 %).

The pool is sized by bytes (EngineConfig.kv_cache_bytes), so int8 holds about twice the
tokens of a 16-bit cache. Whole blocks move together: a block index selects the same rows of
the caches and of their scales.
"""

from __future__ import annotations

import torch

from loraplex.engine.models.spec import ModelSpec
from loraplex.engine.weights.rotation import hadamard

KV_CACHE_DTYPES = ("auto", "int8")
SCALE_DTYPE = torch.float16


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype, kv_cache_dtype: str):
    """Bytes of one block across all layers, K and V, scales included."""
    rows = 2 * spec.num_layers * block_size * spec.num_kv_heads  # (token, head) rows
    if kv_cache_dtype == "int8":
        return rows * (spec.head_dim + SCALE_DTYPE.itemsize)
    return rows * spec.head_dim * dtype.itemsize


def allocate_kv_cache(
    attentions: list, num_blocks: int, block_size: int, dtype: torch.dtype,
    kv_cache_dtype: str, device: torch.device,
) -> None:  # fmt: skip
    """Give each attention layer its k_cache / v_cache (and k_scale / v_scale for int8)."""
    for attn in attentions:
        s = attn.spec
        shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
        # Zeroed: masked-out scores multiply these values, and 0 * NaN would poison a row.
        if kv_cache_dtype == "int8":
            attn.k_cache = torch.zeros(shape, dtype=torch.int8, device=device)
            attn.v_cache = torch.zeros(shape, dtype=torch.int8, device=device)
            attn.k_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
            attn.v_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
            d = s.head_dim
            attn.kv_rotation = hadamard(d, device=device) if d & (d - 1) == 0 else None
        else:
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            attn.k_scale = attn.v_scale = attn.kv_rotation = None


def copy_kv_blocks(attentions: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] in every layer, scales with their rows."""
    for attn in attentions:
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            t = getattr(attn, name)
            if t is not None:
                t[dst] = t[src]
