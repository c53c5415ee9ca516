"""int8 KV cache (per-token-per-head scales): the Triton write and attention against the torch
reference, and the reference against attention over the float cache."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import cpu, kv_cache, paged_attention, reference
from tests.kernels.conftest import tolerance
from tests.kernels.test_paged_attention import _batch

HEADS = [(4, 4, 32), (8, 2, 64), (4, 1, 256)]  # MHA, GQA, MQA with Gemma 3's head_dim
# bf16 only compiled on a GPU: the interpreter's bf16 arithmetic is broken (TRITON_ON_CPU.md)
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                             reason="needs CUDA"))  # fmt: skip


def _quantized(caches):
    """int8 caches + float16 scales holding the float caches' values (NaN rows -> scale NaN)."""
    out = []
    for cache in caches:
        q, s = reference.quantize_kv(cache.nan_to_num(0.0))
        out += [q, s]
    return out[0], out[2], out[1], out[3]  # k, v, k_scale, v_scale


def test_quantize_kv_error_bound(gen):
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-6, 3, 50).view(50, 1, 1)
    x[7, 1] = 0.0  # an all-zero row: scale 0, no division by zero
    q, s = reference.quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == x.shape[:-1]
    back = q.float() * s.float().unsqueeze(-1)
    # Half a step of the row's own scale, plus the float16 rounding of the scale (relative
    # 2^-11, absolute 2^-25 among float16's subnormals) over up to 127 steps.
    bound = x.abs().amax(-1, keepdim=True) / 127 * (0.5 + 127 * 2**-11) + 127 * 2**-25
    assert ((back - x).abs() <= bound).all()
    assert back[7, 1].abs().sum() == 0 and q.abs().max() == 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_write_int8_matches_reference(device, gen, dtype):
    kvh, d, page = 2, 24, 4
    qkv = torch.randn(7, 3 * kvh * d, generator=gen).to(dtype).to(device) * 3
    k = qkv[:, kvh * d : 2 * kvh * d].unflatten(-1, (kvh, d))  # strided, as in the engine
    v = qkv[:, 2 * kvh * d :].unflatten(-1, (kvh, d))
    slots = torch.tensor([5, 0, 22, 23, 9, -1, 13], device=device)
    got = [torch.full((6, page, kvh, d), 99, dtype=torch.int8, device=device) for _ in "kv"]
    got += [torch.full((6, page, kvh), float("nan"), dtype=torch.float16, device=device)
            for _ in "kv"]  # fmt: skip
    want = [t.clone() for t in got]
    kv_cache.write_kv_cache(got[0], got[1], k, v, slots, got[2], got[3])
    keep = slots >= 0
    reference.write_kv_cache(want[0], want[1], k[keep], v[keep], slots[keep], want[2], want[3])
    for g, w in zip(got, want, strict=True):
        if g.dtype == torch.int8:  # floor(x/s + 0.5) may land on the other side of a tie
            assert (g.int() - w.int()).abs().max() <= 1
            assert (g != w).float().mean() < 0.01
        else:  # a GPU's fp32 division may be off by an ulp: the float16 scale by one step
            torch.testing.assert_close(g.nan_to_num(7.0), w.nan_to_num(7.0), rtol=1e-3, atol=0)
    assert (~got[2].isnan()).sum() == 6 * kvh  # only the 6 real slots got a scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize(
    ("page", "contexts", "news", "window"),
    [(16, [5, 40, 0], [1, 1, 1], None), (8, [0, 37, 16, 5], [20, 9, 1, 1], None),
     (16, [50, 3], [1, 12], 8)],
    ids=["decode", "mixed", "window"],
)  # fmt: skip
def test_int8_attention_kernel_vs_reference(device, gen, dtype, heads, page, contexts, news,
                                            window):  # fmt: skip
    _, clean, q, tables, qsl, lens = _batch(device, gen, dtype, heads, page, contexts, news)
    k8, v8, ks, vs = _quantized(clean)
    scale = heads[2] ** -0.5
    expected = torch.zeros_like(q)
    reference.paged_attention(expected, q, k8, v8, tables, qsl, lens, scale, window, None,
                              ks, vs)  # fmt: skip
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_attention(out, q, k8, v8, tables, qsl, lens, scale, window, None,
                                    ks, vs)  # fmt: skip
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", cpu.ATTENTION_IMPLS)
def test_int8_cpu_path_close_to_float_cache(gen, dtype, impl):
    """The CPU path's int8 attention (both forms) stays within quantization error of the same
    step over the float cache."""
    heads = (8, 2, 64)
    _, clean, q, tables, qsl, lens = _batch(
        "cpu", gen, dtype, heads, 8, contexts=[0, 37, 16, 5, 70], news=[20, 9, 1, 1, 1]
    )
    scale = heads[2] ** -0.5
    want = torch.zeros_like(q)
    reference.paged_attention(want, q, *clean, tables, qsl, lens, scale)
    got = torch.zeros_like(q)
    cpu.paged_attention(got, q, *_quantized(clean)[:2], tables, qsl, lens, scale,
                        None, None, *_quantized(clean)[2:], impl=impl)  # fmt: skip
    err = (got.float() - want.float()).abs().max().item()
    assert 0 < err < 0.05  # int8 rounding shows, but stays small (values ~N(0, 1))
