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


def test_lora_apply_builds_no_tiles_when_given_the_steps_plan(device, gen, monkeypatch):
    """Given the step's plan (one per width set, built before the forward: the layers of a
    step share the segments; a slot refilled at another width gets its own), lora_apply builds
    no tile metadata; a direct call without one builds its own each time and keeps nothing;
    the result stays the reference's."""
    dtype = torch.float32
    a, b, widths, segments, x, _, y = _case(
        device, gen, dtype, requests=5, num_adapters=3, ranks=[8], mix="uniform",
        no_adapter=False, prefill=False,
    )  # fmt: skip
    builds = []
    real = sgmv.build_meta
    monkeypatch.setattr(sgmv, "build_meta", lambda *a, **k: builds.append(1) or real(*a, **k))
    narrower = [w // 2 if i == segments[0][2] else w for i, w in enumerate(widths)]
    plans = {tuple(ws): sgmv.build_meta(segments, ws, device) for ws in (widths, narrower)}
    assert len(builds) == 2
    for ws in (widths, narrower, widths, narrower):
        got, expected = y.clone(), y.clone()
        reference.lora_apply(expected, x, a, b, segments, ws)
        sgmv.lora_apply(got, x, a, b, segments, ws, plan=plans[tuple(ws)])
        torch.testing.assert_close(got, expected, **tolerance(dtype))
    assert len(builds) == 2
    sgmv.lora_apply(y.clone(), x, a, b, segments, widths)
    sgmv.lora_apply(y.clone(), x, a, b, segments, widths)
    assert len(builds) == 4
