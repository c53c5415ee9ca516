"""Grouped GEMM (Triton) for mixture-of-experts: rows sorted by group, each group's rows times
its own weight matrix, in one launch.

    x [P, K]   rows sorted by group:   | g0 rows | g1 rows | (g2 empty) | g3 rows | ...
                                       0       offs[0]   offs[1] = offs[2]      offs[3]
    w [G, K, N]                        w[g]: group g's weights (any strides)
    y [P, N]                           y[rows of g] = x[rows of g] @ w[g]

A program owns one BLOCK_M-row block of one group and one BLOCK_N-column tile of y. The block
-> group map is built on the device with torch ops (no host sync, so the launch can be
captured in a CUDA graph): each group holds ceil(count / BLOCK_M) blocks, and the grid is the
bound cdiv(P, BLOCK_M) + min(G, P) on the number of blocks (a non-empty group adds at most one
partial block), its unused programs returning at once. Empty groups get no block, so the LoRA
use (G = adapter slots x experts, most groups empty, K or N = rank) costs what its rows cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, y_ptr, offs_ptr, block_group_ptr, block_row_ptr,
    N, K, stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    g = tl.load(block_group_ptr + pid)
    if g < 0:
        return
    row0 = tl.load(block_row_ptr + pid)
    row_end = tl.load(offs_ptr + g)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
    w_ptrs = (
        w_ptr + g.to(tl.int64) * stride_wg + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            # The interpreter's bf16 dot is wrong (triton-lang/triton#11584): fp32 on the CPU.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    tl.store(
        y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def block_map(offs: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """Each row block's group and first row, computed on offs' device without a host sync.

    Shape: offs [G] int32 cumulative row ends. Returns block_group, block_row
    [cdiv(num_rows, block_m) + min(G, num_rows)] int32; a block past the last is group -1.
    """
    g = offs.shape[0]
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [G]
    nblocks = (counts + block_m - 1) // block_m
    cum = torch.cumsum(nblocks, 0)  # [G] blocks up to and including group g
    bound = -(-num_rows // block_m) + min(g, num_rows)
    b = torch.arange(bound, device=offs.device)
    group = torch.searchsorted(cum, b, right=True)  # the group whose blocks hold block b
    valid = group < g
    gc = group.clamp(max=g - 1)
    row = ends[gc] - counts[gc] + (b - (cum[gc] - nblocks[gc])) * block_m
    return (
        torch.where(valid, group, -1).to(torch.int32),
        torch.where(valid, row, 0).to(torch.int32),
    )


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Semantics: as reference.grouped_mm (torch._grouped_mm for 2-D x, 3-D w):
    y[offs[g-1]:offs[g]] = x[offs[g-1]:offs[g]] @ w[g] (offs[-1] = 0), accumulated in float32,
    returned in x's dtype. Rows from offs[G-1] on are left unspecified, as torch does.

    Shape: x [P, K] fp32/fp16/bf16 (any strides); w [G, K, N] x's dtype (any strides, e.g.
    the transposed view of [G, N, K]); offs [G] int32, non-decreasing, offs[G-1] <= P.
    Returns y [P, N].

    Launch parameters (speed only): block_m rows of one group per program (default from the
    mean rows per non-empty group), block_n, block_k (at least 16: tl.dot's minimum), warps.
    """
    p, k = x.shape
    g, k2, n = w.shape
    assert k2 == k and offs.shape == (g,) and w.dtype == x.dtype
    y = torch.empty(p, n, dtype=x.dtype, device=x.device)
    if p == 0 or g == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    # Decode spreads a few rows over many groups (small blocks waste less), prefill many.
    block_m = block_m or min(64, max(16, triton.next_power_of_2(-(-p // min(g, p)))))
    block_n = block_n or min(128, max(16, triton.next_power_of_2(n)))
    block_k = block_k or min(64, max(16, triton.next_power_of_2(k)))
    block_group, block_row = block_map(offs, p, block_m)
    opts = {"num_warps": num_warps} if num_warps else {}
    upcast = not x.is_cuda and x.dtype == torch.bfloat16
    grid = (block_group.shape[0], triton.cdiv(n, block_n))
    _grouped_mm_kernel[grid](
        x, w, y, offs, block_group, block_row,
        n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, **opts,
    )  # fmt: skip
    return y
