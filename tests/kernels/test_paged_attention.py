"""KV-cache write and paged attention kernels against the torch reference."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import kv_cache, paged_attention, reference
from tests.kernels.conftest import tolerance

# (num_heads, kv_heads, head_dim): MHA, GQA, MQA with Gemma 3's head_dim 256.
HEADS = [(4, 4, 32), (8, 2, 64), (4, 1, 256)]


def _batch(device, gen, dtype, heads, page, contexts, news):
    """Sequences with `contexts[i]` cached tokens plus `news[i]` new ones, random blocks.

    Returns the caches (unused blocks and slots past each sequence hold NaN), the same caches
    with zeros there (the reference multiplies padding keys by 0), and the step's inputs.
    """
    h, kvh, d = heads
    lens = [c + n for c, n in zip(contexts, news, strict=True)]
    need = [-(-n // page) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used : used + n])
        used += n
    width = max(need)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    shape = (num_blocks, page, kvh, d)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    slots = torch.tensor(
        [t[p // page] * page + p % page for t, n in zip(tables, lens, strict=True)
         for p in range(n)], device=device,
    )  # fmt: skip
    k = torch.randn(len(slots), kvh, d, generator=gen).to(dtype).to(device)
    v = torch.randn(len(slots), kvh, d, generator=gen).to(dtype).to(device)
    reference.write_kv_cache(k_cache, v_cache, k, v, slots)
    clean_k, clean_v = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    qsl = [0]
    for n in news:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], h, d, generator=gen).to(dtype).to(device)
    return (k_cache, v_cache), (clean_k, clean_v), q, block_tables, qsl, lens


def _compare(device, gen, dtype, heads, page, contexts, news, window=None, softcap=None):
    caches, clean, q, tables, qsl, lens = _batch(device, gen, dtype, heads, page, contexts, news)
    scale = heads[2] ** -0.5
    expected = torch.zeros_like(q)
    reference.paged_attention(expected, q, *clean, tables, qsl, lens, scale, window, softcap)
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_attention(out, q, *caches, tables, qsl, lens, scale, window, softcap)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("batch", [1, 5])
def test_decode(device, gen, dtype, heads, batch):
    contexts = torch.randint(0, 70, (batch,), generator=gen).tolist()
    _compare(device, gen, dtype, heads, 16, contexts, [1] * batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_prefill_over_cached_prefix_mixed_with_decode(device, gen, dtype, heads):
    # A fresh prompt, a chunk after a cached prefix (chunked prefill / prefix cache hit) and
    # two decode rows in one step.
    _compare(device, gen, dtype, heads, 8, contexts=[0, 37, 16, 5], news=[20, 9, 1, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 8, 30])
def test_sliding_window(device, gen, dtype, window):
    _compare(device, gen, dtype, (4, 1, 256), 16, contexts=[50, 3, 40], news=[1, 12, 1],
             window=window)  # fmt: skip


def test_softcap(device, gen):
    _compare(device, gen, torch.float32, (8, 2, 64), 16, contexts=[10, 0], news=[1, 7],
             softcap=0.5)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_cache_scatters_to_slots(device, gen, dtype):
    kvh, d, page = 2, 24, 4
    shape = (6, page, kvh, d)
    caches = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(4)]
    # k, v are strided views, as the split of a fused qkv projection gives them.
    qkv = torch.randn(7, 3 * kvh * d, generator=gen).to(dtype).to(device)
    k = qkv[:, kvh * d : 2 * kvh * d].unflatten(-1, (kvh, d))
    v = qkv[:, 2 * kvh * d :].unflatten(-1, (kvh, d))
    slots = torch.tensor([5, 0, 22, 23, 9, -1, 13], device=device)
    kv_cache.write_kv_cache(caches[0], caches[1], k, v, slots)
    keep = slots >= 0  # the reference has no padding slots: leave -1 out
    reference.write_kv_cache(caches[2], caches[3], k[keep], v[keep], slots[keep])
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))
    assert caches[0].isnan().sum() == caches[0].numel() - 6 * kvh * d  # only 6 slots written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("heads", "split_kv", "block_n"),
    [((8, 2, 64), 3, 16), ((4, 1, 256), 2, 32), ((8, 2, 64), 1, 32)],
)
def test_launch_overrides_and_split_kv(device, gen, dtype, heads, split_kv, block_n):
    """Split-KV decode (more splits than some short contexts have key blocks, so some splits
    see nothing) next to prefill rows, with other launch parameters: same results."""
    caches, clean, q, tables, qsl, lens = _batch(
        device, gen, dtype, heads, 8, contexts=[0, 37, 70, 5, 40], news=[1, 9, 1, 1, 1]
    )
    scale = heads[2] ** -0.5
    expected = torch.zeros_like(q)
    reference.paged_attention(expected, q, *clean, tables, qsl, lens, scale, None, None)
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_attention(
        out, q, *caches, tables, qsl, lens, scale, block_n=block_n, decode_block_m=32,
        split_kv=split_kv, num_warps=2, num_stages=2,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(dtype))
