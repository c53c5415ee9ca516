"""Factories for kernel tests: adapter popularity mixes, slot weights, NaN-guarded tensors."""

from __future__ import annotations

import torch

MIXES = ("distinct", "uniform", "zipf:1.5", "identical", "skewed")


def pick_adapters(mix: str, num_requests: int, num_adapters: int, gen: torch.Generator):
    """Adapter index (0..num_adapters-1) of each request, following a popularity mix."""
    if mix == "distinct":
        return [i % num_adapters for i in range(num_requests)]
    if mix == "identical":
        return [0] * num_requests
    if mix == "uniform":
        probs = torch.ones(num_adapters)
    elif mix.startswith("zipf:"):
        probs = 1.0 / torch.arange(1, num_adapters + 1).float() ** float(mix.split(":")[1])
    elif mix == "skewed":
        # One hot adapter takes ~80% of the requests, the rest share the remainder.
        probs = torch.full((num_adapters,), 0.2 / max(1, num_adapters - 1))
        probs[0] = 0.8 if num_adapters > 1 else 1.0
    else:
        raise ValueError(mix)
    return torch.multinomial(probs, num_requests, replacement=True, generator=gen).tolist()


def make_segments(slots: list[int], lengths: list[int]) -> tuple[list[tuple[int, int, int]], int]:
    """Order requests by slot as the model runner does and merge equal neighbours."""
    order = sorted(range(len(slots)), key=lambda i: slots[i])
    segments: list[tuple[int, int, int]] = []
    row = 0
    for i in order:
        if segments and segments[-1][2] == slots[i]:
            segments[-1] = (segments[-1][0], row + lengths[i], slots[i])
        else:
            segments.append((row, row + lengths[i], slots[i]))
        row += lengths[i]
    return segments, row


def guarded(shape: tuple[int, ...], dtype: torch.dtype, device, gen: torch.Generator, pad=3):
    """Random tensor that is a strided view into a NaN-filled buffer: reads past it show."""
    buf = torch.full([s + 2 * pad for s in shape], float("nan"), dtype=dtype, device=device)
    inner = buf[tuple(slice(pad, pad + s) for s in shape[:-1])][..., pad : pad + shape[-1]]
    inner.copy_(torch.randn(shape, generator=gen).to(dtype))
    return buf, inner


def slot_weights(
    ranks: list[int],
    in_features: int,
    out_sizes: list[int],
    num_slots: int,
    max_rank: int,
    dtype: torch.dtype,
    device,
    gen: torch.Generator,
):
    """Stacked LoRA slots in the engine layout; unused rows and unused slots hold NaN.

    Slot i holds an adapter of rank ranks[i] on every slice: A stacked along the rank
    dimension, B^T block-diagonal over the slices with a scale folded in.
    """
    k = len(out_sizes)
    a = torch.full((num_slots, k * max_rank, in_features), float("nan"), dtype=dtype)
    b = torch.full((num_slots, k * max_rank, sum(out_sizes)), float("nan"), dtype=dtype)
    widths = [0] * num_slots
    for slot, r in enumerate(ranks):
        w = k * r
        a[slot, :w] = torch.randn(w, in_features, generator=gen).to(dtype) / in_features**0.5
        b[slot, :w] = 0
        off = 0
        for i, n in enumerate(out_sizes):
            scale = 2.0 / r
            b[slot, i * r : (i + 1) * r, off : off + n] = (
                torch.randn(r, n, generator=gen) * scale
            ).to(dtype)
            off += n
        widths[slot] = w
    return a.to(device), b.to(device), widths
