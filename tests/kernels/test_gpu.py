"""GPU-only kernel checks: bf16, serving-sized shapes, CUDA-graph replay equals eager.

Run on a machine with CUDA: `pytest -m gpu tests/kernels` (scripts/gpu_check.sh does).
"""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import reference
from tests.utils.kernels import make_segments, pick_adapters, slot_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BF16 = torch.bfloat16


def _close(got, expected, tol=3e-2):
    scale = expected.float().abs().amax().clamp_min(1.0)
    torch.testing.assert_close(got.float() / scale, expected.float() / scale, atol=tol, rtol=tol)


def _lora_case(gen, rows_per_req, requests, num_adapters=32, rank=16, hidden=4096):
    out_sizes = [4096, 1024, 1024]  # Llama-8B q|k|v
    a, b, widths = slot_weights([rank] * num_adapters, hidden, out_sizes, num_adapters,
                                rank, BF16, "cuda", gen)  # fmt: skip
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    slots = pick_adapters("uniform", requests, num_adapters, gen)
    slots = [-1 if i % 5 == 0 else s for i, s in enumerate(slots)]
    segments, rows = make_segments(slots, [rows_per_req] * requests)
    x = torch.randn(rows, hidden, generator=gen).to("cuda", BF16)
    y = torch.randn(rows, sum(out_sizes), generator=gen).to("cuda", BF16)
    return a, b, widths, segments, x, y


@pytest.mark.parametrize("rows_per_req,requests", [(1, 64), (128, 6)], ids=["decode", "prefill"])
def test_sgmv_bf16(rows_per_req, requests):
    from loraplex.kernels import sgmv

    gen = torch.Generator().manual_seed(0)
    a, b, widths, segments, x, y = _lora_case(gen, rows_per_req, requests)
    expected = y.float()
    reference.lora_apply(expected, x.float(), a.float(), b.float(), segments, widths)
    sgmv.lora_apply(y, x, a, b, segments, widths)
    _close(y, expected)


def test_sgmv_cuda_graph_replay_equals_eager():
    from loraplex.kernels import sgmv

    gen = torch.Generator().manual_seed(1)
    a, b, widths, segments, x, y0 = _lora_case(gen, 1, 64)
    meta = sgmv.build_meta(segments, widths, "cuda", block_m=16, num_tiles=64)
    y = y0.clone()
    sgmv.lora_apply_meta(y0.clone(), x, a, b, meta, split_k=4)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        sgmv.lora_apply_meta(y, x, a, b, meta, split_k=4)
    for seed in range(3):
        # New batch composition copied into the captured buffers, then replayed.
        slots = pick_adapters("zipf:1.5", 64, 32, torch.Generator().manual_seed(seed))
        segs, _ = make_segments(slots, [1] * 64)
        fresh = sgmv.build_meta(segs, widths, "cuda", block_m=16, num_tiles=64)
        for name in ("tile_start", "tile_end", "tile_slot"):
            getattr(meta, name).copy_(getattr(fresh, name))
        y.copy_(y0)
        graph.replay()
        eager = y0.clone()
        sgmv.lora_apply_meta(eager, x, a, b, fresh, split_k=4)
        torch.cuda.synchronize()
        _close(y, eager, tol=1e-2)


@pytest.mark.parametrize("heads,window", [((32, 8, 128), None), ((4, 1, 256), 512)],
                         ids=["llama-gqa", "gemma-mqa-window"])  # fmt: skip
def test_paged_attention_bf16(heads, window):
    from loraplex.kernels import kv_cache, paged_attention

    gen = torch.Generator().manual_seed(2)
    h, kvh, d = heads
    page, contexts, news = 16, [1000, 37, 700, 0, 2000], [1, 1, 64, 300, 1]
    lens = [c + n for c, n in zip(contexts, news, strict=True)]
    need = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(need) + 8, generator=gen).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used : used + n])
        used += n
    bt = torch.tensor([t + [0] * (max(need) - len(t)) for t in tables], device="cuda")
    k_cache = torch.zeros(len(perm), page, kvh, d, dtype=BF16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([t[p // page] * page + p % page for t, n in zip(tables, lens, strict=True)
                          for p in range(n)], device="cuda")  # fmt: skip
    k = torch.randn(len(slots), kvh, d, generator=gen).to("cuda", BF16)
    v = torch.randn(len(slots), kvh, d, generator=gen).to("cuda", BF16)
    kv_cache.write_kv_cache(k_cache, v_cache, k, v, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.write_kv_cache(ref_k, ref_v, k, v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    qsl = [0]
    for n in news:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], h, d, generator=gen).to("cuda", BF16)
    expected = torch.zeros(q.shape, device="cuda")
    reference.paged_attention(expected, q.float(), k_cache.float(), v_cache.float(), bt, qsl,
                              lens, d**-0.5, window)  # fmt: skip
    out = torch.empty_like(q)
    paged_attention.paged_attention(out, q, k_cache, v_cache, bt, qsl, lens, d**-0.5, window)
    _close(out, expected)


@pytest.mark.parametrize("m", [1, 16, 300])
def test_dequant_matmul_bf16(m):
    from loraplex.kernels import dequant_matmul

    gen = torch.Generator().manual_seed(3)
    n, k, g = 4096, 4096, 128
    x = torch.randn(m, k, generator=gen).to("cuda", BF16)
    q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).cuda()
    s8 = (torch.rand(n, generator=gen) / 500).to("cuda", BF16)
    _close(dequant_matmul.int8_matmul(x, q8, s8), reference.int8_matmul(x.float(), q8, s8))
    q4 = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).cuda()
    s4 = (torch.rand(n, k // g, generator=gen) / 100).to("cuda", BF16)
    z4 = (torch.randn(n, k // g, generator=gen) / 100).to("cuda", BF16)
    got = dequant_matmul.int4_matmul(x, q4, s4, z4, g)
    _close(got, reference.int4_matmul(x.float(), q4, s4, z4, g))


def test_dequant_cuda_graph_replay_equals_eager():
    from loraplex.kernels import dequant_matmul

    gen = torch.Generator().manual_seed(4)
    n, k, g = 2048, 1024, 128
    x = torch.randn(4, k, generator=gen).to("cuda", BF16)
    q4 = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).cuda()
    s4 = (torch.rand(n, k // g, generator=gen) / 100).to("cuda", BF16)
    z4 = torch.zeros(n, k // g, device="cuda", dtype=BF16)
    dequant_matmul.int4_matmul(x, q4, s4, z4, g)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = dequant_matmul.int4_matmul(x, q4, s4, z4, g)
    for seed in range(2):
        x.copy_(torch.randn(4, k, generator=torch.Generator().manual_seed(seed)).to(BF16))
        graph.replay()
        _close(y, dequant_matmul.int4_matmul(x, q4, s4, z4, g), tol=1e-2)
