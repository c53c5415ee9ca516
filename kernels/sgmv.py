"""SGMV: batched LoRA over rows grouped by adapter slot, as two Triton kernels.

    shrink   t[rows of tile, :w_s]  = x[rows] @ lora_a[s, :w_s]^T     (split-K, fp32 buffer)
    expand   y[rows of tile, n-blk] += t[rows, :w_s] @ lora_b[s, :w_s, n-blk]   (in place)

Work is cut into row tiles of BLOCK_M rows that never cross a segment, so every program reads
one adapter's weights. Prefill segments span many tiles; decode (BGMV, one or a few rows per
adapter) gives one tile per segment. A slot's width w_s covers all its slices side by side
(q|k|v, gate|up: B is block-diagonal, scale folded in), so one launch serves every slice and
every rank: programs whose rank block starts past w_s exit before reading anything, and tiles
of slot -1 (rows without an adapter) read no weights at all.

The tile list lives in device tensors (`SGMVMeta`) and can be padded to a fixed length with
slot -1 tiles, so a captured CUDA graph replays with new segments copied into the same buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from loraplex.kernels.plans import SGMVMeta


def build_meta(
    segments: Sequence[tuple[int, int, int]],
    widths: Sequence[int],
    device: torch.device,
    block_m: int | None = None,
    num_tiles: int | None = None,
) -> SGMVMeta:
    """Cut (start, end, slot) segments into row tiles; pad to `num_tiles` with empty tiles."""
    if block_m is None:
        longest = max((e - s for s, e, _ in segments), default=1)
        block_m = 16 if longest <= 16 else (32 if longest <= 32 else 64)
    rows: list[tuple[int, int, int]] = []
    for s, e, slot in segments:
        if slot < 0 or widths[slot] == 0:
            continue  # no tile at all: those rows read nothing
        rows.extend((m, e, slot) for m in range(s, e, block_m))
    if num_tiles is not None:
        assert len(rows) <= num_tiles, f"{len(rows)} tiles exceed the padded {num_tiles}"
        rows.extend([(0, 0, -1)] * (num_tiles - len(rows)))
    if not rows:
        rows = [(0, 0, -1)]
    tiles = torch.tensor(rows, dtype=torch.int32).T.contiguous().to(device)  # [3, num_tiles]
    w = torch.tensor(list(widths), dtype=torch.int32).to(device)
    return SGMVMeta(tiles[0], tiles[1], tiles[2], w, block_m)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, t_ptr, tile_start_ptr, tile_end_ptr, tile_slot_ptr, widths_ptr,
    K, stride_xm, stride_as, stride_ar, stride_tm,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    width = tl.load(widths_ptr + slot)
    r0 = tl.program_id(1) * BLOCK_R
    if r0 >= width:
        return  # this rank block is beyond the adapter's width: read nothing
    rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(tile_end_ptr + tile)
    ranks = r0 + tl.arange(0, BLOCK_R)
    rank_ok = ranks < width
    # Each split-K program owns a BLOCK_K-aligned chunk of K.
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(2) * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    a_cols = a_ptr + slot.to(tl.int64) * stride_as + ranks[None, :].to(tl.int64) * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        ks = k + offs_k
        k_ok = ks < k_hi
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_cols + ks[:, None], mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
        acc = tl.dot(xt, at.to(xt.dtype), acc, input_precision="ieee")  # [BLOCK_M, BLOCK_R]
    t_ptrs = t_ptr + rows[:, None].to(tl.int64) * stride_tm + ranks[None, :]
    mask = row_ok[:, None] & rank_ok[None, :]
    if SPLIT_K == 1:
        tl.store(t_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(t_ptrs, acc, mask=mask)


@triton.jit
def _expand_kernel(
    t_ptr, b_ptr, y_ptr, tile_start_ptr, tile_end_ptr, tile_slot_ptr, widths_ptr,
    slice_ends_ptr, N, stride_tm, stride_bs, stride_br, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SLICES: tl.constexpr = 1,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    width = tl.load(widths_ptr + slot)
    rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(tile_end_ptr + tile)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offs_r = tl.arange(0, BLOCK_R)
    t_rows = t_ptr + rows[:, None].to(tl.int64) * stride_tm
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    r_lo = width * 0
    r_hi = width
    if NUM_SLICES > 1:
        # B is block-diagonal over equal-rank slices: a column block inside one slice only
        # needs that slice's rank rows (the others are zero); a block across slices reads all.
        first = width * 0
        last = width * 0
        n_lo = tl.program_id(1) * BLOCK_N
        n_last = tl.minimum(n_lo + BLOCK_N, N) - 1
        for i in tl.static_range(NUM_SLICES - 1):
            end = tl.load(slice_ends_ptr + i)
            first += (n_lo >= end).to(tl.int32)
            last += (n_last >= end).to(tl.int32)
        if first == last:
            r_lo = first * (width // NUM_SLICES)
            r_hi = r_lo + width // NUM_SLICES
    for r in range(r_lo, r_hi, BLOCK_R):
        ranks = r + offs_r
        rank_ok = ranks < r_hi
        tt = tl.load(t_rows + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        bt = tl.load(
            b_slot + ranks[:, None].to(tl.int64) * stride_br,
            mask=rank_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(tt.to(bt.dtype), bt, acc, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def _rank_block(max_width: int) -> int:
    return max(16, min(64, triton.next_power_of_2(max_width)))


def _launch_opts(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    """Triton launch options that were given (None keeps Triton's default)."""
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    return {k: v for k, v in opts.items() if v is not None}


# Default launch parameters, from a GPU sweep (docs/gpu.md): only decode-shaped tiles
# (block_m <= 16, every segment <= 16 rows) take the measured choice.
DECODE_BLOCK_M = 16


def shrink_params(
    num_tiles: int,
    block_m: int,
    max_width: int,
    k: int,
    *,
    split_k: int | None = None,
    block_k: int | None = None,
    block_r: int | None = None,
) -> dict[str, int]:
    """sgmv_shrink's launch parameters: the given ones, the default for the others.

    Decode tiles: block_k 128 for K <= 4096, else 64; split K up to ~512 programs, at most
    32 splits and one block_k per split. Prefill tiles keep the earlier rule. The
    measurements behind it are in docs/gpu.md ("Default launch parameters").
    """
    block_r = block_r or _rank_block(max_width)
    base = num_tiles * triton.cdiv(max_width, block_r)
    if block_m <= DECODE_BLOCK_M:
        block_k = block_k or (128 if k <= 4096 else 64)
        if split_k is None:
            split_k = max(1, min(triton.cdiv(512, base), 32, triton.cdiv(k, block_k)))
    else:
        block_k = block_k or 64
        if split_k is None:
            # Few tiles: split K until the GPU has a couple of programs per SM.
            split_k = max(1, min(triton.cdiv(256, base), triton.cdiv(k, 4 * block_k)))
    return {"split_k": split_k, "block_k": block_k, "block_r": block_r}


def expand_params(
    num_tiles: int,
    block_m: int,
    max_width: int,
    n: int,
    *,
    block_n: int | None = None,
    block_r: int | None = None,
) -> dict[str, int]:
    """sgmv_expand's launch parameters: the given ones, the default for the others.

    block_n 128 for decode tiles with >= 512 programs at that width (a few per SM of a large
    GPU), else 64: fewer, wider programs only pay when the GPU stays full (docs/gpu.md).
    """
    block_r = block_r or _rank_block(max_width)
    if block_n is None:
        wide = block_m <= DECODE_BLOCK_M and num_tiles * triton.cdiv(n, 128) >= 512
        block_n = 128 if wide else 64
    return {"block_n": block_n, "block_r": block_r}


def sgmv_shrink(
    t: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    meta: SGMVMeta,
    split_k: int | None = None,
    *,
    block_k: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Semantics: t[r, :w_s] = x[r] @ lora_a[s, :w_s]^T for every row r of a tile of slot s;
    other entries of t are left as they are. `t` is written in place (zero it first when
    split_k > 1 or None: the splits add into it, and the default splits).

    Shape: t float32 [num_tokens, max_width]; x [num_tokens, in];
    lora_a [num_slots, max_width, in] (x's dtype or castable to it).

    Launch parameters (block_k, block_r >= 16, split_k, num_warps, num_stages) default to
    `shrink_params`; they change speed only (and the fp32 summation order with split_k).
    """
    assert x.stride(1) == 1 and lora_a.stride(2) == 1 and t.stride(1) == 1
    num_tiles, max_width, k = meta.tile_slot.shape[0], lora_a.shape[1], x.shape[1]
    p = shrink_params(num_tiles, meta.block_m, max_width, k, split_k=split_k,
                      block_k=block_k, block_r=block_r)  # fmt: skip
    grid = (num_tiles, triton.cdiv(max_width, p["block_r"]), p["split_k"])
    _shrink_kernel[grid](
        x, lora_a, t, meta.tile_start, meta.tile_end, meta.tile_slot, meta.widths,
        k, x.stride(0), lora_a.stride(0), lora_a.stride(1), t.stride(0),
        BLOCK_M=meta.block_m, BLOCK_R=p["block_r"], BLOCK_K=p["block_k"],
        SPLIT_K=p["split_k"], **_launch_opts(num_warps, num_stages),
    )  # fmt: skip


def sgmv_expand(
    y: torch.Tensor,
    t: torch.Tensor,
    lora_b: torch.Tensor,
    meta: SGMVMeta,
    *,
    block_n: int | None = None,
    block_r: int | None = None,
    slice_ends: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Semantics: y[r] += t[r, :w_s] @ lora_b[s, :w_s] for every row r of a tile of slot s;
    rows without an adapter are left untouched. `y` is changed in place.

    Shape: y [num_tokens, out]; t float32 [num_tokens, max_width];
    lora_b [num_slots, max_width, out] (scale folded in).

    Launch parameters (block_n, block_r >= 16, num_warps, num_stages) default to
    `expand_params` and change speed only. `slice_ends` (int32 [num_slices] on y's device, the
    cumulative column end of each slice, e.g. q|k|v -> [4096, 5120, 6144]) promises that each
    slot's B is block-diagonal over that many equal-rank slices (rank rows i*w_s/S ..
    (i+1)*w_s/S feed only slice i's columns, zeros elsewhere): column blocks then skip the
    zero rank rows. Same sums when those rows are exactly zero.

    Off unless given: the promise holds for an adapter the engine installed only when it
    targets every slice of the module at one rank (q|k|v all rank r gives w_s = 3r), not for
    one that targets q and v only, or mixes ranks, and the engine's call (`lora_apply`:
    segments and widths) does not carry the slice ranks. What it gains where it holds:
    docs/gpu.md (`python -m benchmarks.kernel_sweep`).
    """
    assert y.stride(1) == 1 and lora_b.stride(2) == 1 and t.stride(1) == 1
    num_tiles, max_width, n = meta.tile_slot.shape[0], lora_b.shape[1], y.shape[1]
    p = expand_params(num_tiles, meta.block_m, max_width, n, block_n=block_n, block_r=block_r)
    block_n, block_r = p["block_n"], p["block_r"]
    num_slices = 1 if slice_ends is None else slice_ends.numel()
    if slice_ends is None:
        slice_ends = meta.widths  # never read with NUM_SLICES == 1
    grid = (num_tiles, triton.cdiv(n, block_n))
    _expand_kernel[grid](
        t, lora_b, y, meta.tile_start, meta.tile_end, meta.tile_slot, meta.widths,
        slice_ends, n, t.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=meta.block_m, BLOCK_R=block_r, BLOCK_N=block_n, NUM_SLICES=num_slices,
        **_launch_opts(num_warps, num_stages),
    )  # fmt: skip


def lora_apply_meta(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    meta: SGMVMeta,
    split_k: int | None = None,
    *,
    slice_ends: torch.Tensor | None = None,
) -> None:
    """y += shrink-then-expand over prebuilt tiles (the CUDA-graph friendly entry point).

    Launch parameters are the defaults (`shrink_params`, `expand_params`); `slice_ends` as
    for sgmv_expand (off unless given)."""
    t = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    sgmv_shrink(t, x, lora_a, meta, split_k)
    sgmv_expand(y, t, lora_b, meta, slice_ends=slice_ends)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    widths: Sequence[int],
    *,
    plan: SGMVMeta | None = None,
) -> None:
    """Same contract as reference.lora_apply: y += per-segment LoRA delta, y changed in place.

    Shape: y [num_tokens, out]; x [num_tokens, in]; lora_a [num_slots, max_width, in];
    lora_b [num_slots, max_width, out]; segments (start, end, slot); widths per slot.
    The default launch parameters; no slice-skipping (the call does not carry slice ranks).
    `plan`: the tiles `build_meta` made for these segments and widths (the step planner's,
    once per step); a direct call without one builds them for itself.
    DoRA's per-row factor is not applied here: the layer applies it after this call, the same
    epilogue on every backend (KernelBackend.dora_apply).
    """
    if not any(slot >= 0 and widths[slot] for _, _, slot in segments):
        return
    if plan is None:
        plan = build_meta(segments, widths, x.device)
    lora_apply_meta(y, x, lora_a, lora_b, plan)
