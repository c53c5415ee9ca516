"""int8 / int4 weight-only matmul kernels against the torch reference."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import dequant_matmul, reference
from tests.kernels.conftest import tolerance
from tests.utils.kernels import guarded


def _int_weights(shape, low, high, dtype, device, gen):
    """Integer weights as a strided view into a junk-filled buffer (reads past it show)."""
    buf = torch.randint(low, high, (shape[0] + 4, shape[1] + 8), generator=gen).to(dtype)
    buf[:2], buf[-2:], buf[:, :4], buf[:, -4:] = high - 1, high - 1, high - 1, high - 1
    return buf.to(device)[2:-2, 4:-4]


def _scaled(y, expected, dtype):
    # The dot of K terms: compare relative to the output magnitude.
    ref_scale = expected.float().abs().amax().clamp_min(1.0)
    torch.testing.assert_close(
        y.float() / ref_scale, expected.float() / ref_scale, **tolerance(dtype)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 37])
@pytest.mark.parametrize("split_k", [1, 3, None])
def test_int8_matmul(device, gen, dtype, m, split_k):
    n, k = 96, 384
    qweight = _int_weights((n, k), -127, 128, torch.int8, device, gen)
    scales = (torch.rand(n, generator=gen) / 50).to(device)
    _, x = guarded((m, k), dtype, device, gen)
    y = dequant_matmul.int8_matmul(x, qweight, scales, split_k=split_k)
    assert y.dtype == dtype and y.shape == (m, n)
    _scaled(y, reference.int8_matmul(x, qweight, scales), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 37])
@pytest.mark.parametrize("group", [128, 64, 32])
def test_int4_matmul(device, gen, dtype, m, group):
    n, k = 80, 256
    qweight = _int_weights((n, k // 2), 0, 256, torch.uint8, device, gen)
    _, scales = guarded((n, k // group), torch.float32, device, gen)
    scales.abs_().mul_(0.05)
    _, zeros = guarded((n, k // group), torch.float32, device, gen)
    zeros.mul_(0.05)
    _, x = guarded((m, k), dtype, device, gen)
    y = dequant_matmul.int4_matmul(x, qweight, scales, zeros, group_size=group)
    assert y.dtype == dtype and y.shape == (m, n)
    _scaled(y, reference.int4_matmul(x, qweight, scales, zeros, group), dtype)


@pytest.mark.parametrize("split_k", [1, 2])
def test_int4_split_k_matches_reference(device, gen, split_k):
    n, k, group = 40, 512, 128
    qweight = _int_weights((n, k // 2), 0, 256, torch.uint8, device, gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.05).half().to(device)
    zeros = (torch.randn(n, k // group, generator=gen) * 0.05).half().to(device)
    x = torch.randn(2, k, generator=gen).to(device)
    y = dequant_matmul.int4_matmul(x, qweight, scales, zeros, group, split_k=split_k)
    expected = reference.int4_matmul(x, qweight, scales, zeros, group)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(("block_k", "split_k"), [(64, 1), (128, 2), (256, None)])
def test_int8_gemv_form(device, gen, dtype, m, block_k, split_k):
    # k = 320 is not a multiple of block_k: the last K tile of a split is partial.
    n, k = 72, 320
    qweight = _int_weights((n, k), -128, 128, torch.int8, device, gen)
    scales = (torch.rand(n, generator=gen) / 50).to(device)
    _, x = guarded((m, k), dtype, device, gen)
    y = dequant_matmul.int8_matmul(
        x, qweight, scales, split_k=split_k, form="gemv", block_n=16, block_k=block_k
    )
    assert y.dtype == dtype and y.shape == (m, n)
    _scaled(y, reference.int8_matmul(x, qweight, scales), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(
    ("group", "block_k", "split_k"),
    [(128, 256, 1), (128, 64, 3), (32, 128, 2), (64, 64, None)],
)
def test_int4_gemv_form(device, gen, dtype, m, group, block_k, split_k):
    n, k = 40, 384
    qweight = _int_weights((n, k // 2), 0, 256, torch.uint8, device, gen)
    _, scales = guarded((n, k // group), torch.float32, device, gen)
    scales.abs_().mul_(0.05)
    _, zeros = guarded((n, k // group), torch.float32, device, gen)
    zeros.mul_(0.05)
    _, x = guarded((m, k), dtype, device, gen)
    y = dequant_matmul.int4_matmul(
        x, qweight, scales, zeros, group_size=group, split_k=split_k, form="gemv",
        block_m=2, block_n=16, block_k=block_k,
    )  # fmt: skip
    assert y.dtype == dtype and y.shape == (m, n)
    _scaled(y, reference.int4_matmul(x, qweight, scales, zeros, group), dtype)


def test_launch_overrides_keep_the_dot_form_exact(device, gen):
    n, k, group = 48, 256, 128
    qweight = _int_weights((n, k // 2), 0, 256, torch.uint8, device, gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.05).to(device)
    zeros = (torch.randn(n, k // group, generator=gen) * 0.05).to(device)
    x = torch.randn(2, k, generator=gen).to(device)
    expected = reference.int4_matmul(x, qweight, scales, zeros, group)
    y = dequant_matmul.int4_matmul(
        x, qweight, scales, zeros, group, split_k=1, block_n=32, block_k=64, num_warps=2
    )
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
def test_default_form_is_gemv_at_one_row_and_dot_above(int4):
    """The measured defaults (kernel-sweep.log, H200): GEMV at M = 1 with block_k 512, the
    dot form from M = 2 on (M = 16 measured); int8 and small int4 layers unsplit."""
    group = 128 if int4 else 1
    one = dequant_matmul.launch_params(1, 4096, 4096, int4, group)
    assert one["form"] == "gemv" and one["block_k"] == 512 and one["split_k"] == 1
    assert one["block_n"] == 32
    big = dequant_matmul.launch_params(1, 4096, 14336, int4, group)
    assert big["form"] == "gemv" and big["block_n"] == (16 if int4 else 32)
    assert big["split_k"] == (4 if int4 else 1)
    for m in (2, 16, 300):
        assert dequant_matmul.launch_params(m, 4096, 4096, int4, group)["form"] == "dot"
    # Explicit choices win over the defaults.
    forced = dequant_matmul.launch_params(16, 4096, 4096, int4, group, 3, form="gemv",
                                          block_n=64, block_k=128)  # fmt: skip
    assert (forced["form"], forced["block_n"], forced["block_k"], forced["split_k"]) == (
        "gemv", 64, 128, 3,
    )  # fmt: skip
    assert dequant_matmul.launch_params(1, 4096, 4096, int4, group, form="dot")["form"] == "dot"


@pytest.mark.parametrize("m", [1, 5])
def test_default_form_matches_reference_and_explicit_forms(device, gen, m):
    """The defaults (GEMV at M = 1, dot above) give the reference's result, as do both
    explicit forms."""
    n, k, group = 48, 256, 64
    q8 = _int_weights((n, k), -128, 128, torch.int8, device, gen)
    s8 = (torch.rand(n, generator=gen) / 50).to(device)
    q4 = _int_weights((n, k // 2), 0, 256, torch.uint8, device, gen)
    s4 = (torch.rand(n, k // group, generator=gen) * 0.05).to(device)
    z4 = (torch.randn(n, k // group, generator=gen) * 0.05).to(device)
    x = torch.randn(m, k, generator=gen).to(device)
    want8 = reference.int8_matmul(x, q8, s8)
    want4 = reference.int4_matmul(x, q4, s4, z4, group)
    for form in (None, "gemv", "dot"):
        y8 = dequant_matmul.int8_matmul(x, q8, s8, form=form)
        y4 = dequant_matmul.int4_matmul(x, q4, s4, z4, group, form=form)
        _scaled(y8, want8, torch.float32)
        _scaled(y4, want4, torch.float32)
