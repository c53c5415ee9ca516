"""SGMV shrink/expand kernels against the torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import reference, sgmv
from tests.kernels.conftest import tolerance
from tests.utils.kernels import MIXES, guarded, make_segments, pick_adapters, slot_weights

QKV = [32, 16, 16]  # three fused slices, as q|k|v


def _case(device, gen, dtype, *, requests, num_adapters, ranks, mix, no_adapter, prefill,
          out_sizes=QKV, in_features=64):  # fmt: skip
    num_slots = num_adapters + 1  # one slot stays empty (NaN): nobody may read it
    max_rank = max(ranks)
    a, b, widths = slot_weights(
        [ranks[i % len(ranks)] for i in range(num_adapters)],
        in_features, out_sizes, num_slots, max_rank, dtype, device, gen,
    )  # fmt: skip
    slots = pick_adapters(mix, requests, num_adapters, gen)
    if no_adapter:
        slots = [-1 if i % 3 == 1 else s for i, s in enumerate(slots)]
    lengths = (
        torch.randint(1, 40, (requests,), generator=gen).tolist() if prefill else [1] * requests
    )
    segments, rows = make_segments(slots, lengths)
    _, x = guarded((rows, in_features), dtype, device, gen)
    ybuf, y = guarded((rows, sum(out_sizes)), dtype, device, gen)
    return a, b, widths, segments, x, ybuf, y


def _check(a, b, widths, segments, x, ybuf, y, dtype):
    expected = y.clone()
    reference.lora_apply(expected, x, a, b, segments, widths)
    before = ybuf.clone()
    sgmv.lora_apply(y, x, a, b, segments, widths)
    torch.testing.assert_close(y.float(), expected.float(), **tolerance(dtype))
    # Rows without an adapter are bit-identical, and nothing outside y was written.
    for s, e, slot in segments:
        if slot < 0:
            assert torch.equal(y[s:e], before[3 : 3 + y.shape[0]][s:e, 3 : 3 + y.shape[1]])
    outside = torch.ones_like(ybuf, dtype=torch.bool)
    outside[3 : 3 + y.shape[0], 3 : 3 + y.shape[1]] = False
    assert ybuf[outside].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("no_adapter", [False, True], ids=["all", "some-none"])
@pytest.mark.parametrize("mix", MIXES)
def test_popularity_mixes(device, gen, dtype, mix, no_adapter):
    case = _case(device, gen, dtype, requests=12, num_adapters=4, ranks=[4, 8],
                 mix=mix, no_adapter=no_adapter, prefill=False)  # fmt: skip
    _check(*case, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ranks", [[1], [16], [64], [1, 2, 8, 64]], ids=str)
@pytest.mark.parametrize("requests,num_adapters", [(1, 1), (7, 3), (33, 8)])
def test_ranks_and_batch_sizes_decode(device, gen, dtype, ranks, requests, num_adapters):
    case = _case(device, gen, dtype, requests=requests, num_adapters=num_adapters, ranks=ranks,
                 mix="uniform", no_adapter=True, prefill=False)  # fmt: skip
    _check(*case, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mix", ["distinct", "zipf:1.5"])
def test_prefill_segments_span_several_tiles(device, gen, dtype, mix):
    case = _case(device, gen, dtype, requests=5, num_adapters=3, ranks=[2, 16, 32],
                 mix=mix, no_adapter=True, prefill=True, out_sizes=[48, 80])  # fmt: skip
    _check(*case, dtype)


@pytest.mark.parametrize("split_k", [1, 3])
def test_shrink_alone_matches_reference_per_segment(device, gen, split_k):
    dtype = torch.float32
    a, _, widths, segments, x, _, _ = _case(
        device, gen, dtype, requests=6, num_adapters=3, ranks=[1, 8, 16], mix="uniform",
        no_adapter=True, prefill=True, in_features=200,
    )  # fmt: skip
    meta = sgmv.build_meta(segments, widths, device)
    t = torch.zeros(x.shape[0], a.shape[1], device=device)
    sgmv.sgmv_shrink(t, x, a, meta, split_k=split_k)
    for (s, e, _slot), tj in zip(segments, reference.sgmv_shrink(x, a, segments, widths),
                                strict=True):  # fmt: skip
        if tj is None:
            assert (t[s:e] == 0).all()  # rows without an adapter were not touched
        else:
            torch.testing.assert_close(t[s:e, : tj.shape[1]], tj, **tolerance(dtype))
            assert (t[s:e, tj.shape[1] :] == 0).all()


def test_padded_tiles_do_nothing(device, gen):
    """Metadata padded with empty tiles (the CUDA-graph form) gives the same result."""
    dtype = torch.float32
    a, b, widths, segments, x, _, y = _case(
        device, gen, dtype, requests=4, num_adapters=2, ranks=[8], mix="distinct",
        no_adapter=False, prefill=False,
    )  # fmt: skip
    expected = y.clone()
    reference.lora_apply(expected, x, a, b, segments, widths)
    meta = sgmv.build_meta(segments, widths, device, num_tiles=9)
    sgmv.lora_apply_meta(y, x, a, b, meta)
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("ranks", [[8], [4, 8, 16]], ids=["one-width", "mixed-widths"])
def test_reference_batched_decode_path_equals_per_segment(ranks, monkeypatch):
    """The oracle's batched path (many short segments, grouped by width) against its plain
    per-segment shrink/expand; rows past each slot's width and the spare slot hold NaN."""
    monkeypatch.setattr(reference, "DENSE_MAX_COLUMNS", 0)
    gen = torch.Generator().manual_seed(3)
    a, b, widths, segments, x, _, y = _case(
        "cpu", gen, torch.float32, requests=40, num_adapters=18, ranks=ranks, mix="uniform",
        no_adapter=True, prefill=False,
    )  # fmt: skip
    assert sum(1 for *_, slot in segments if slot >= 0) >= 3 * len(set(ranks))  # batched
    batched, plain = y.clone(), y.clone()
    reference.lora_apply(batched, x, a, b, segments, widths)
    t = reference.sgmv_shrink(x, a, segments, widths)
    reference.sgmv_expand(plain, t, b, segments, widths)
    assert batched.isfinite().all()
    torch.testing.assert_close(batched, plain)
    assert not torch.equal(batched, y)  # the deltas were added


@pytest.mark.parametrize("ranks", [[8], [4, 8]], ids=["one-width", "mixed-widths"])
def test_reference_decode_rows_beside_prefills_run_batched(ranks, monkeypatch):
    """A step with the decode rows of many adapters and a few long prefill chunks: the oracle
    batches the decode rows and runs the prefills one by one, with the plain per-segment
    result; NaN past the widths and in the spare slot."""
    monkeypatch.setattr(reference, "DENSE_MAX_COLUMNS", 0)
    gen = torch.Generator().manual_seed(4)
    num_adapters, dtype, in_features = 30, torch.float32, 64
    a, b, widths = slot_weights(
        [ranks[i % len(ranks)] for i in range(num_adapters)],
        in_features, QKV, num_adapters + 1, max(ranks), dtype, "cpu", gen,
    )  # fmt: skip
    lengths = [1] * 24 + [50, 1, 37, 1, 29, 1]
    segments, rows = make_segments(list(range(num_adapters)), lengths)
    _, x = guarded((rows, in_features), dtype, "cpu", gen)
    _, y = guarded((rows, sum(QKV)), dtype, "cpu", gen)
    plan = reference._lora_groups(segments, widths, x.device)
    for _width, segs, index in plan:  # the long segments alone, the decode rows batched
        assert all((e - s > 1) == (index is None) for s, e, _ in segs)
    assert sum(len(segs) for _, segs, _ in plan) == num_adapters
    batched, plain = y.clone(), y.clone()
    reference.lora_apply(batched, x, a, b, segments, widths)
    reference.sgmv_expand(plain, reference.sgmv_shrink(x, a, segments, widths), b, segments,
                          widths)  # fmt: skip
    assert batched.isfinite().all()
    torch.testing.assert_close(batched, plain)


def test_reference_plan_follows_the_widths_of_the_same_segments():
    """The oracle keeps its per-step plan keyed by segments and widths: the same segments
    with a slot refilled at another width must get a new plan, not the old one."""
    gen = torch.Generator().manual_seed(5)
    a, b, widths, segments, x, _, y = _case(
        "cpu", gen, torch.float32, requests=30, num_adapters=10, ranks=[8], mix="uniform",
        no_adapter=False, prefill=False,
    )  # fmt: skip
    for ws in (widths, [w // 2 if i % 2 else w for i, w in enumerate(widths)], widths):
        batched, plain = y.clone(), y.clone()
        reference.lora_apply(batched, x, a, b, segments, ws)
        reference.sgmv_expand(plain, reference.sgmv_shrink(x, a, segments, ws), b, segments, ws)
        torch.testing.assert_close(batched, plain)


def _plain(y, x, a, b, segments, widths):
    out = y.clone()
    reference.sgmv_expand(out, reference.sgmv_shrink(x, a, segments, widths), b, segments, widths)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [[8], [2, 8]], ids=["one-width", "mixed-widths"])
def test_reference_few_adapters_run_dense(dtype, ranks):
    """Few adapters (the stacked columns within DENSE_MAX_COLUMNS) run as two matmuls over
    all of them: decode rows and prefill chunks, rows without an adapter, one slot in several
    segments; NaN past the widths and in the spare slot, which nobody may read."""
    gen = torch.Generator().manual_seed(6)
    num_adapters = 3
    a, b, widths = slot_weights(
        [ranks[i % len(ranks)] for i in range(num_adapters)],
        64, QKV, num_adapters + 1, max(ranks), dtype, "cpu", gen,
    )  # fmt: skip
    # Not sorted by slot: slot 0 and 1 come back after others (as in any order of rows).
    segments = [(0, 1, 0), (1, 2, 1), (2, 3, -1), (3, 20, 2), (20, 21, 0), (21, 30, 1),
                (30, 31, -1), (31, 33, 2)]  # fmt: skip
    rows = 33
    _, x = guarded((rows, 64), dtype, "cpu", gen)
    _, y = guarded((rows, sum(QKV)), dtype, "cpu", gen)
    plan = reference._lora_groups(segments, widths, x.device)
    assert plan and all(isinstance(index, reference._Dense) for *_, index in plan)
    dense = y.clone()
    reference.lora_apply(dense, x, a, b, segments, widths)
    assert dense.isfinite().all()
    torch.testing.assert_close(dense, _plain(y, x, a, b, segments, widths), **tolerance(dtype))
    for s, e, slot in segments:
        if slot < 0:
            assert torch.equal(dense[s:e], y[s:e])  # untouched, bit for bit
        else:
            assert not torch.equal(dense[s:e], y[s:e])


def test_reference_dense_run_uses_the_slots_in_place_when_they_are_all_of_them():
    """Every slot of the maximum width in use, from slot 0: no gather, same result."""
    gen = torch.Generator().manual_seed(7)
    a, b, widths = slot_weights([8, 8], 64, QKV, 2, 8, torch.float32, "cpu", gen)
    segments, rows = make_segments([1, 0, 1], [1, 1, 5])
    x, y = torch.randn(rows, 64, generator=gen), torch.randn(rows, sum(QKV), generator=gen)
    [(width, _, index)] = reference._lora_groups(segments, widths, x.device)
    assert index.from_zero and width == a.shape[1]
    assert reference._stacked(a, index, width).data_ptr() == a.data_ptr()  # a view
    dense = y.clone()
    reference.lora_apply(dense, x, a, b, segments, widths)
    torch.testing.assert_close(dense, _plain(y, x, a, b, segments, widths))


def test_reference_dense_run_keeps_rows_apart_when_another_adapter_overflows():
    """In float16, row 0's input times adapter 1's A overflows to inf. Row 0 uses adapter 0
    and row 1 adapter 1: the dense run selects (not multiplies) each row's own columns, so
    row 0 stays finite and equal to the per-segment result."""
    gen = torch.Generator().manual_seed(8)
    a, b, widths = slot_weights([8, 8], 64, QKV, 2, 8, torch.float32, "cpu", gen)
    a[1] = 1e3  # finite, as loading checks, but large
    x = torch.randn(2, 64, generator=gen)
    x[0], x[1] = 100.0, x[1] * 1e-3  # x[0] @ a[1]^T = 6.4e6: beyond float16
    a, b, x = a.half(), b.half(), x.half()
    y = torch.zeros(2, sum(QKV), dtype=torch.float16)
    segments = [(0, 1, 0), (1, 2, 1)]
    assert isinstance(reference._lora_groups(segments, widths, x.device)[0][2], reference._Dense)
    assert not torch.isfinite(x[:1] @ a[1].t()).all()
    dense = y.clone()
    reference.lora_apply(dense, x, a, b, segments, widths)
    assert dense.isfinite().all()
    torch.testing.assert_close(dense, _plain(y, x, a, b, segments, widths))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("block_n", "block_k", "split_k", "sliced"),
    [(16, 32, 2, True), (32, 128, 1, True), (128, 64, 4, False)],
)
def test_launch_overrides_and_slice_skipping(device, gen, dtype, block_n, block_k, split_k,
                                             sliced):  # fmt: skip
    """Launch parameters change nothing; with slice_ends, column blocks inside one slice read
    only its rank rows (block_n 32 makes blocks that straddle slices and read them all)."""
    out_sizes = [48, 16, 32]
    a, b, widths, segments, x, ybuf, y = _case(
        device, gen, dtype, requests=9, num_adapters=3, ranks=[4, 8], mix="uniform",
        no_adapter=True, prefill=True, out_sizes=out_sizes, in_features=160,
    )  # fmt: skip
    expected = y.clone()
    reference.lora_apply(expected, x, a, b, segments, widths)
    meta = sgmv.build_meta(segments, widths, device)
    t = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=device)
    sgmv.sgmv_shrink(t, x, a, meta, split_k, block_k=block_k, block_r=16, num_warps=2)
    ends = torch.tensor([48, 64, 96], dtype=torch.int32, device=device) if sliced else None
    sgmv.sgmv_expand(y, t, b, meta, block_n=block_n, block_r=16, slice_ends=ends, num_stages=2)
    torch.testing.assert_close(y.float(), expected.float(), **tolerance(dtype))
    outside = torch.ones_like(ybuf, dtype=torch.bool)
    outside[3 : 3 + y.shape[0], 3 : 3 + y.shape[1]] = False
    assert ybuf[outside].isnan().all()


def test_default_launch_parameters_follow_the_sweep():
    """Decode tiles take the measured defaults (kernel-sweep.log, H200); prefill tiles keep
    the earlier rule; explicit parameters win."""
    # Batch 64, 32 adapters x 2 rows: 32 tiles of 16 rows; qkv width 48 / K 4096, down K 14336.
    assert sgmv.shrink_params(32, 16, 48, 4096) == {"split_k": 16, "block_k": 128, "block_r": 64}
    assert sgmv.shrink_params(32, 16, 16, 14336) == {"split_k": 16, "block_k": 64, "block_r": 16}
    assert sgmv.shrink_params(1, 16, 48, 4096)["split_k"] == 32  # batch 1
    assert sgmv.shrink_params(8, 64, 48, 4096) == {"split_k": 16, "block_k": 64, "block_r": 64}
    assert sgmv.shrink_params(32, 16, 48, 4096, split_k=1, block_k=32) == {
        "split_k": 1, "block_k": 32, "block_r": 64,
    }  # fmt: skip
    assert sgmv.shrink_params(2, 16, 48, 64)["split_k"] == 1  # K shorter than one block
    assert sgmv.expand_params(32, 16, 48, 6144)["block_n"] == 128
    assert sgmv.expand_params(1, 16, 48, 6144)["block_n"] == 64  # too few programs
    assert sgmv.expand_params(32, 64, 48, 6144)["block_n"] == 64  # prefill tiles
    assert sgmv.expand_params(32, 16, 48, 6144, block_n=32)["block_n"] == 32


@pytest.mark.parametrize("requests", [1, 6])
def test_default_split_k_equals_unsplit_shrink(device, gen, requests):
    """The default shrink splits K at decode (many programs over few tiles); its fp32 sums
    equal split_k=1's within rounding, and lora_apply's result the reference's."""
    dtype = torch.float32
    a, b, widths, segments, x, _, y = _case(
        device, gen, dtype, requests=requests, num_adapters=3, ranks=[4, 16], mix="uniform",
        no_adapter=True, prefill=False, in_features=384,
    )  # fmt: skip
    meta = sgmv.build_meta(segments, widths, device)
    params = sgmv.shrink_params(len(meta.tile_slot), meta.block_m, a.shape[1], x.shape[1])
    assert params["split_k"] > 1 and params["block_k"] == 128
    split = torch.zeros(x.shape[0], a.shape[1], device=device)
    plain = torch.zeros_like(split)
    sgmv.sgmv_shrink(split, x, a, meta)
    sgmv.sgmv_shrink(plain, x, a, meta, split_k=1)
    torch.testing.assert_close(split, plain, atol=1e-5, rtol=1e-5)
    expected = y.clone()
    reference.lora_apply(expected, x, a, b, segments, widths)
    sgmv.lora_apply(y, x, a, b, segments, widths)
    torch.testing.assert_close(y, expected, **tolerance(dtype))


def test_lora_apply_reuses_tiles_for_the_same_segments_and_widths(device, gen):
    """lora_apply builds the tile metadata once per (segments, widths) value: a slot refilled
    at another width gets new tiles, and the result stays the reference's."""
    dtype = torch.float32
    a, b, widths, segments, x, _, y = _case(
        device, gen, dtype, requests=5, num_adapters=3, ranks=[8], mix="uniform",
        no_adapter=False, prefill=False,
    )  # fmt: skip
    sgmv._METAS.clear()
    first = sgmv._meta(segments, widths, x.device)
    assert sgmv._meta(list(segments), list(widths), x.device) is first
    narrower = [w // 2 if i == segments[0][2] else w for i, w in enumerate(widths)]
    assert sgmv._meta(segments, narrower, x.device) is not first
    for ws in (widths, narrower, widths):
        got, expected = y.clone(), y.clone()
        reference.lora_apply(expected, x, a, b, segments, ws)
        sgmv.lora_apply(got, x, a, b, segments, ws)
        torch.testing.assert_close(got, expected, **tolerance(dtype))
