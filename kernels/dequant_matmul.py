"""Weight-only int8 / int4 matmul (Triton): y = x @ dequant(W)^T with fp16/bf16/fp32 x.

Both formats share one kernel shape: a program owns a [BLOCK_M, BLOCK_N] tile of y and a
chunk of K (split-K, for the GEMV case where M is tiny and N alone gives too few programs).
Weights stay quantized in memory and are widened tile by tile; the scales are applied to the
dot products, not to each weight, because they are constant along a tile's K:

    int8   y[m, n]  = scales[n] * sum_k x[m, k] q[n, k]
    int4   per K tile inside group g:
           y[m, n] += scales[n, g] * sum_k x[m, k] (q[n, k] - 8) + zeros[n, g] * sum_k x[m, k]

    int4 packing (qweight uint8 [N, K // 2]):  byte j of row n = q[n, 2j+1] << 4 | q[n, 2j]
    so a tile multiplies the low nibbles by x's even columns and the high ones by odd columns.

(q - 8) is in [-8, 7] and int8 q in [-128, 127], both exact in fp16/bf16, so the tensor-core
dot sees exact weights; only x's rounding and the fp32 accumulation order remain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_matmul_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
    INT4: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(2) * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    q_rows = q_ptr + cols[:, None].to(tl.int64) * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if INT4:
        HALF: tl.constexpr = BLOCK_K // 2
        offs_j = tl.arange(0, HALF)  # byte index within the tile
        for k in range(k_lo, k_hi, BLOCK_K):
            ks = k + 2 * offs_j  # even column of each byte
            x_mask = row_ok[:, None] & (ks < K)[None, :]
            x_even = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)  # [BLOCK_M, HALF]
            x_odd = tl.load(x_rows + ks[None, :] + 1, mask=x_mask, other=0.0)
            packed = tl.load(
                q_rows + (k // 2 + offs_j)[None, :],
                mask=col_ok[:, None] & (ks < K)[None, :],
                other=0,
            ).to(tl.int32)  # [BLOCK_N, HALF]
            lo = ((packed & 0xF) - 8).to(x_even.dtype)
            hi = ((packed >> 4) - 8).to(x_even.dtype)
            part = tl.dot(x_even, tl.trans(lo), input_precision="ieee")
            part = tl.dot(x_odd, tl.trans(hi), part, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
            g = k // GROUP  # BLOCK_K divides GROUP: the whole tile is in one group
            scale = tl.load(s_ptr + cols * stride_sn + g, mask=col_ok, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + cols * stride_sn + g, mask=col_ok, other=0.0).to(tl.float32)
            x_sum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), 1)  # [BLOCK_M]
            acc += part * scale[None, :] + x_sum[:, None] * zero[None, :]
    else:
        offs_k = tl.arange(0, BLOCK_K)
        for k in range(k_lo, k_hi, BLOCK_K):
            ks = k + offs_k
            k_ok = ks < k_hi
            xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            qt = tl.load(q_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
            acc = tl.dot(xt, tl.trans(qt.to(xt.dtype)), acc, input_precision="ieee")
        scale = tl.load(s_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc * scale[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


def _launch(x, qweight, scales, zeros, n, int4, group, split_k):
    assert x.dim() == 2 and x.stride(1) == 1 and qweight.stride(1) == 1
    m, k = x.shape
    if int4:
        # One tile must sit inside one group and hold >= 16 columns of each parity.
        block_k = min(128, group & -group)
        assert group % block_k == 0 and block_k >= 32, f"int4 group size {group} unsupported"
        assert scales.stride() == zeros.stride() and scales.stride(1) == 1
    else:
        block_k = 128 if k % 128 == 0 else 64
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if m <= 16 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k is None:
        # GEMV / small batch: split K until the GPU has a few programs per SM.
        split_k = max(1, min(triton.cdiv(512, tiles), triton.cdiv(k, 2 * block_k), 16))
    if split_k == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _dequant_matmul_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, y,
        m, n, k, x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        INT4=int4, GROUP=group,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
    )  # fmt: skip
    return y.to(x.dtype)


def int8_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, split_k: int | None = None
) -> torch.Tensor:
    """Weight-only int8 linear, per-output-channel symmetric scales.

    Semantics: y = x @ W^T with W[n, k] = qweight[n, k] * scales[n].

    Shape: x [M, K] fp16/bf16/fp32 (last dim contiguous); qweight int8 [N, K];
    scales float [N] (contiguous). Returns y [M, N] in x's dtype.
    """
    return _launch(x, qweight, scales.contiguous(), None, qweight.shape[0], False, 1, split_k)


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int = 128,
    split_k: int | None = None,
) -> torch.Tensor:
    """Weight-only int4 linear, asymmetric group-wise along K (group G, K % G == 0).

    Semantics: y = x @ W^T with W[n, k] = (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G],
    q[n, 2j] = qweight[n, j] & 0xF and q[n, 2j + 1] = qweight[n, j] >> 4.

    Shape: x [M, K] fp16/bf16/fp32 (last dim contiguous); qweight uint8 [N, K // 2];
    scales, zeros float [N, K // G]. Returns y [M, N] in x's dtype.
    """
    assert x.shape[1] % group_size == 0, "K must be a multiple of the int4 group size"
    n = qweight.shape[0]
    return _launch(
        x, qweight, scales.contiguous(), zeros.contiguous(), n, True, group_size, split_k
    )
