"""torch's CPU int4 weight layout (`_weight_int4pack_mm_for_cpu`) and the canonical one.

canonical   uint8 [N, K // 2]: byte j of row n = q[n, 2j] | q[n, 2j + 1] << 4, q in [0, 15]
CPU layout  uint8 [N, K // 2] viewed as [N // B, K, B // 2]:
            byte [b, k, j] = q[B b + j, k] | q[B b + B // 2 + j, k] << 4   j in [0, B // 2)
            with the block B torch's build picked for this CPU: 64 with AVX-512, 32 with
            AVX2 only (`cpu_int4_block` finds it out once, by packing a probe with torch's
            own converter).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("loraplex.engine")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Shape: q [N, K] integers in [0, 15] -> uint8 [N, K // 2], even columns in low nibbles."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


@functools.cache
def cpu_int4_block() -> int | None:
    """Rows per block of `_weight_int4pack_mm_for_cpu`'s weight layout on this CPU (64 with
    AVX-512, 32 with AVX2 only), found by comparing torch's converter with each candidate on
    a probe; None when neither matches or the op is missing (the fast CPU path is then off)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=gen)
    try:
        theirs = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    except (AttributeError, RuntimeError):
        return None
    for block in (64, 32):
        if torch.equal(theirs, to_cpu_int4_layout(pack_int4(q), block)):
            return block
    log.warning("torch's CPU int4 weight layout is not one loraplex knows: int4 runs unpacked")
    return None


def to_cpu_int4_layout(qweight: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Canonical uint8 [N, K // 2] -> the layout of `_weight_int4pack_mm_for_cpu`
    (N % block == 0; block: `cpu_int4_block()` unless given)."""
    block = block or cpu_int4_block()
    q = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).flatten(-2)  # [N, K]
    n, k = q.shape
    halves = q.view(n // block, 2, block // 2, k)  # rows Bb + j and Bb + B/2 + j share a byte
    packed = halves[:, 0] | (halves[:, 1] << 4)  # [N // B, B // 2, K]
    return packed.transpose(1, 2).contiguous().view(n, k // 2)


def from_cpu_int4_layout(packed: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Inverse of `to_cpu_int4_layout`: back to the canonical uint8 [N, K // 2]."""
    block = block or cpu_int4_block()
    n, k = packed.shape[0], packed.shape[1] * 2
    b = packed.view(n // block, k, block // 2).transpose(1, 2)  # [N // B, B // 2, K]
    q = torch.stack([b & 0xF, b >> 4], dim=1).reshape(n, k)
    return pack_int4(q)


def dequantize_cpu_int4(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The weight, in `dtype`, straight from the CPU op's layout (no canonical copy).

    Shape: packed uint8 [N, K // 2] (CPU layout); scales, zeros [N, K // G] -> [N, K].
    """
    n, k, block = packed.shape[0], packed.shape[1] * 2, cpu_int4_block()
    b = packed.view(n // block, k, block // 2)
    q = torch.stack([b & 0xF, b >> 4], dim=1).transpose(-1, -2)  # [N // B, 2, B // 2, K]
    q = q.reshape(n, k // group_size, group_size).to(dtype)
    w = torch.addcmul(zeros.to(dtype).unsqueeze(-1), q - 8, scales.to(dtype).unsqueeze(-1))
    return w.view(n, k)
