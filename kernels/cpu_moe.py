"""The CPU backend's mixture-of-experts ops (`reference.py`'s semantics): the grouped matmul
over experts, and expert LoRA with each row through its own group's A and B, read in place.
engine/models/moe.py reaches them through its KernelBackend; tests/kernels/test_moe_triton.py
and tests/engine/test_moe.py check them against the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm needs a unit stride in each matrix and its other strides a multiple
    of 16 bytes."""
    align = 16 // t.element_size()
    strides = list(t.stride())
    unit = -1 if strides[-1] == 1 else -2
    if strides[unit] != 1:
        return False
    del strides[unit]
    return all(s % align == 0 for s in strides)


# What one per-group call of torch._grouped_mm costs, as bytes of gathered weights: the
# per-row form is taken while the matrices it copies beyond one per group stay under this
# per group (benchmarks/moe.py measures the expert LoRA that depends on it).
_CALL_BYTES = 64 * 1024


def _take(w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """w.index_select(0, index), copied in w's own memory order: a transposed view (nn.Linear
    rows, [G, N, K] seen as [G, K, N]) gathered as the rows it is, then viewed back, rather
    than transposed element by element into a new layout."""
    if w.stride(1) == 1 and w.stride(2) != 1:
        return w.transpose(1, 2).index_select(0, index).transpose(1, 2)
    return w.index_select(0, index)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`reference.grouped_mm` with torch's grouped matmul.

    torch._grouped_mm's CPU form runs one matmul per group, each at a fixed cost, empty or
    not: when most groups are empty (LoRA over adapter slots x experts) it runs over the
    non-empty groups only, whose weights it gathers (small then: rank x features each). When
    those hold a row or two each (a decode step: one row per virtual expert), every row
    takes its group's matrix instead and all rows go through one batched matmul: a gather of
    rows x K x N, no per-group call. That form copies a matrix for every row past a group's
    first; it is taken while those copies are small next to the calls they save (LoRA's
    rank x features matrices, never the experts' own at a decode step). Shapes
    torch._grouped_mm cannot take (a rank below 16 bytes) are zero-padded. Rows from
    offs[G-1] on are unspecified.
    """
    p, (g, k, n) = x.shape[0], w.shape
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    used = counts.nonzero().squeeze(1)  # [groups with rows]
    if used.numel() == 0:
        return x.new_zeros(p, n)
    rows, groups = int(offs[-1]), used.numel()
    if rows <= 2 * groups and (rows - groups) * k * n * w.element_size() <= groups * _CALL_BYTES:
        group = torch.repeat_interleave(torch.arange(g, device=x.device), counts,
                                        output_size=rows)  # fmt: skip
        if x.dtype == w.dtype == torch.float32 and w.is_contiguous():
            # Each row a sum of its group's K weight rows scaled by its own K values: one
            # embedding_bag reads them in place, without gathering a copy first.
            index = (group.unsqueeze(1) * k + torch.arange(k, device=x.device)).flatten()
            bags = torch.arange(0, rows * k, k, device=x.device)
            y = F.embedding_bag(index, w.view(g * k, n), bags, mode="sum",
                                per_sample_weights=x[:rows].flatten())  # fmt: skip
        else:
            y = torch.matmul(x[:rows].unsqueeze(1), _take(w, group)).squeeze(1)
        return y if rows == p else torch.cat([y, y.new_zeros(p - rows, n)])
    if 4 * groups <= g:
        w, offs = _take(w, used), offs.index_select(0, used)
    if _aligned(x) and _aligned(w):
        return torch._grouped_mm(x, w, offs=offs)
    align = 16 // x.element_size()
    kp, np_ = -(-k // align) * align, -(-n // align) * align
    xp = x.new_zeros(p, kp)
    xp[:, :k] = x
    wp = w.new_zeros(w.shape[0], kp, np_)
    wp[:, :k, :n] = w
    return torch._grouped_mm(xp, wp, offs=offs)[:, :n]


# The shrink of `grouped_lora_rows` reads A^T in place through embedding_bag while a row of the
# table (the width read per input feature) is at least this many bytes; under it the
# per-index cost of embedding_bag outweighs copying each row's whole A^T block.
_SHRINK_ROW_BYTES = 32


def grouped_lora_rows(x: torch.Tensor, a_t: torch.Tensor, b: torch.Tensor, group: torch.Tensor,
                      width: int) -> torch.Tensor:  # fmt: skip
    """delta[p] = (x[p] @ a_t[group[p], :, :width]) @ b[group[p], :width]: each row through its
    own group's LoRA (expert LoRA at a decode step: about one row per adapter slot x expert),
    the per-row form of two `grouped_mm` calls that needs no sort by group.

    Shape: x [P, K]; a_t [G, K, Wa] (each group's A transposed) and b [G, Wb, N], both
    contiguous (width <= Wa, Wb: a group's A columns and B rows past its own width are zeros);
    group [P] int64. Returns [P, N] in x's dtype.

    The stacks are read in place through embedding_bag, which sums table rows scaled by
    per-row weights (float32, bf16 and fp16 alike: it accumulates in float32 and rounds once,
    as the matmul it replaces does, and in bf16 it is about 3.5 times faster than copying
    each row's blocks, at a decode step of the tiny Qwen3-MoE in benchmarks/moe.py): the
    expand sums row p's `width` rows of B scaled by its shrunk values; the shrink its K rows
    of A^T scaled by x[p], each row split at `width` where that divides Wa, so the zero
    columns past it are not read. A narrow shrink (rank 2: a few bytes per index) copies each
    row's A^T block instead and multiplies."""
    p, (g, k, wa), (wb, n) = x.shape[0], a_t.shape, b.shape[1:]
    dev = x.device
    # int32 indices (half the bytes to write and read) while the tables' rows fit
    index = torch.int32 if g * max(k * wa, wb) < 2**31 else torch.int64
    group = group.to(index)
    c = width if wa % width == 0 else wa
    in_place = (torch.float32, torch.bfloat16, torch.float16)
    if x.dtype == a_t.dtype in in_place and c * a_t.element_size() >= _SHRINK_ROW_BYTES:
        split = wa // c  # table rows per A^T row
        rows = group.unsqueeze(1) * (k * split) + torch.arange(0, k * split, split, device=dev,
                                                               dtype=index)  # fmt: skip
        bags = torch.arange(0, p * k, k, device=dev, dtype=index)
        xa = F.embedding_bag(rows.flatten(), a_t.view(-1, c), bags, mode="sum",
                             per_sample_weights=x.flatten())[:, :width]  # fmt: skip
    else:
        xa = torch.matmul(x.unsqueeze(1), a_t.index_select(0, group)[:, :, :width]).squeeze(1)
    if xa.dtype == b.dtype in in_place:
        rows = group.unsqueeze(1) * wb + torch.arange(width, device=dev, dtype=index)
        bags = torch.arange(0, p * width, width, device=dev, dtype=index)
        return F.embedding_bag(rows.flatten(), b.view(-1, n), bags, mode="sum",
                               per_sample_weights=xa.flatten())  # fmt: skip
    gb = b.index_select(0, group)[:, :width]  # other dtypes: each row's B rows copied
    return torch.matmul(xa.unsqueeze(1), gb).squeeze(1)
