"""The int8 / int4 weight-only reference ops follow the quantized-weight contract."""

from __future__ import annotations

import torch

from loraplex.kernels import dispatch, reference


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> uint8 [N, K // 2], column 2j low nibble, 2j + 1 high nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def test_int8_matmul_matches_dequantized_linear(gen):
    w = torch.randn(24, 64, generator=gen)
    scales = w.abs().amax(1) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    x = torch.randn(5, 64, generator=gen)
    y = dispatch.int8_matmul(x, q, scales)
    assert y.shape == (5, 24) and y.dtype == x.dtype
    # Close to x @ W^T: each weight is off by at most half a quantization step.
    assert (y - x @ w.T).abs().max() < 0.3
    expected = x @ (q.float() * scales[:, None]).T
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_int4_layout_is_low_nibble_first(gen):
    n, k, g = 3, 256, 128
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales, zeros = torch.rand(n, k // g, generator=gen), torch.randn(n, k // g, generator=gen)
    w = reference.dequantize_int4(pack_int4(q), scales, zeros, g)
    for row, col in [(0, 0), (0, 1), (1, 127), (1, 128), (2, 255)]:
        expected = (q[row, col] - 8) * scales[row, col // g] + zeros[row, col // g]
        torch.testing.assert_close(w[row, col], expected.float())


def test_int4_matmul_in_activation_dtype(gen):
    n, k, g = 16, 128, 64
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales, zeros = torch.rand(n, k // g, generator=gen) / 8, torch.randn(n, k // g) / 8
    x = torch.randn(4, k, generator=gen).half()
    y = dispatch.int4_matmul(x, pack_int4(q), scales, zeros, group_size=g)
    assert y.dtype == torch.float16 and y.shape == (4, n)
    w = (q.float() - 8) * scales.repeat_interleave(g, 1) + zeros.repeat_interleave(g, 1)
    torch.testing.assert_close(y.float(), x.float() @ w.T, atol=2e-2, rtol=2e-2)
