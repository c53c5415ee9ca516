"""Hadamard rotations (incoherence processing, as in QuIP# and QuaRot): int4 weights are
rounded in a rotated basis per group of input channels (engine/weights/quantization.py), and
the int8 KV cache stores rotated q/k/v (engine/memory/kv_cache.py)."""

from __future__ import annotations

import torch


def hadamard(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix [n, n] (n a power of 2): symmetric, H H = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of 2, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype=dtype, device=device)


def rotate_groups(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Each group of G = h.shape[0] consecutive last-dim entries times h: t blockdiag(h).

    Shape: t [..., K] (K % G == 0), h [G, G] -> [..., K].
    """
    return (t.reshape(-1, h.shape[0]) @ h).reshape(t.shape)  # one 2-D matmul: fastest on CPU


def rotate_xtx(xtx: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """blockdiag(h)^T xtx blockdiag(h): the second moment of rotated inputs. [K, K] -> [K, K]."""
    k, g = xtx.shape[0], h.shape[0]
    blocks = xtx.reshape(k // g, g, k // g, g)
    return torch.einsum("ca,iajb,bd->icjd", h, blocks, h).reshape(k, k)
