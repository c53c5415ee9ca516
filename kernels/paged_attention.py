"""Paged attention (Triton): decode and variable-length prefill over block tables.

One kernel serves both. A program owns one query tile of one sequence and one KV head:

    M rows of the tile = BLOCK_Q query tokens x GP query heads of that KV head (GQA/MQA:
                         GP = next power of two of heads-per-KV-head; extra rows masked)
    keys               = positions lo .. last query position of the tile, gathered in blocks
                         of BLOCK_N through the block table (any page size)

so decode (one token per sequence) reads each KV head's cache once for all its query heads,
and a prefill chunk attends over the cached prefix blocks written by earlier steps (chunked
prefill, prefix caching) as well as its own new tokens. The softmax is online (running max
and sum in fp32). Key positions at or beyond a sequence's length are never loaded, so cache
blocks that were never written are never read. Layers with attention sinks (gpt-oss) launch
_paged_attention_sinks_kernel, the same tile code whose running max and sum start from each
head's sink logit (a key with a zero value).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from loraplex.kernels.plans import TritonAttentionPlan

PREFILL_BLOCK_M = 64  # rows of a prefill tile (query rows x query heads of one kv head)


@triton.jit
def _attention_tile(
    seq, out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    tile_row_ptr, q_end_ptr, seq_len_ptr,
    scale, softcap, window,
    stride_ot, stride_oh, stride_qt, stride_qh, stride_cs, stride_ch, stride_bt,
    part_ptr, ml_ptr, stride_ms, num_heads,
    k_scale_ptr, v_scale_ptr, stride_ss, sinks_ptr,
    PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, SPLIT_KV: tl.constexpr,
    KV_INT8: tl.constexpr, USE_SINKS: tl.constexpr,
):  # fmt: skip
    """One program's work: query tile program_id(0) of sequence `seq`, KV head
    program_id(1), key split program_id(2)."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    row0 = tl.load(tile_row_ptr + tile)
    q_end = tl.load(q_end_ptr + seq)
    seq_len = tl.load(seq_len_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    tok = row0 + offs_m // GP  # query row of each M row
    g = offs_m % GP
    row_ok = (tok < q_end) & (g < GROUP)
    q_pos = seq_len - (q_end - tok)  # absolute position of each query
    head = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    hi = tl.minimum(seq_len, seq_len - (q_end - (row0 + BLOCK_Q)))  # last query pos + 1
    lo = 0
    if USE_WINDOW:
        first_pos = seq_len - (q_end - row0)
        lo = tl.maximum(0, first_pos - window + 1) // BLOCK_N * BLOCK_N
    qk_scale = scale * 1.4426950408889634  # exp2 domain

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if USE_SINKS:
        # The sink is one more logit with a zero value: the running max and sum start from
        # it (in the first key split only, so the merge counts it once).
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        first = tl.program_id(2) == 0
        m_i = tl.where(first, sink * 1.4426950408889634, m_i)
        l_i = tl.where(first & (sink > float("-inf")), 1.0, l_i)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if SPLIT_KV > 1:
        # Split-KV (flash-decoding): program_id(2) takes one BLOCK_N-aligned chunk of the keys
        # and writes its unnormalized partial; _combine_splits_kernel merges them.
        chunk = tl.cdiv(tl.cdiv(hi - lo, SPLIT_KV), BLOCK_N) * BLOCK_N
        lo = lo + tl.program_id(2) * chunk
        hi = tl.minimum(hi, lo + chunk)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        block = tl.load(table + k_pos // PAGE, mask=k_ok, other=0)
        slot = block.to(tl.int64) * PAGE + k_pos % PAGE
        kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if KV_INT8:
            # One scale per (token, kv head): [num_blocks, PAGE, kv_heads] float16.
            s_off = slot * stride_ss + kv_head
            ks = tl.load(k_scale_ptr + s_off, mask=k_ok, other=0.0).to(tl.float32)
            k = k.to(tl.float32) * ks[:, None]
        s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        if USE_SOFTCAP:
            # softcap * tanh(s * scale / softcap), tanh written with a sigmoid (no libdevice).
            s = softcap * (2.0 * tl.sigmoid(2.0 * s * (scale / softcap)) - 1.0) * 1.4426950408889634
        else:
            s = s * qk_scale
        allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_INT8:
            vs = tl.load(v_scale_ptr + s_off, mask=k_ok, other=0.0).to(tl.float32)
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if SPLIT_KV > 1:
        # part [SPLIT_KV, tokens, heads, BLOCK_D], ml [2, SPLIT_KV, tokens, heads] (m, l): fp32.
        idx = tl.program_id(2) * stride_ms + tok.to(tl.int64) * num_heads + head
        tl.store(
            part_ptr + (idx * BLOCK_D)[:, None] + dims[None, :],
            acc,
            mask=row_ok[:, None] & d_ok[None, :],
        )
        tl.store(ml_ptr + idx, m_i, mask=row_ok)
        tl.store(ml_ptr + SPLIT_KV * stride_ms + idx, l_i, mask=row_ok)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr
            + tok[:, None].to(tl.int64) * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    tile_seq_ptr, tile_row_ptr, q_end_ptr, seq_len_ptr,
    scale, softcap, window,
    stride_ot, stride_oh, stride_qt, stride_qh, stride_cs, stride_ch, stride_bt,
    part_ptr, ml_ptr, stride_ps, stride_ms, num_heads,
    k_scale_ptr, v_scale_ptr, stride_ss,
    PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, SPLIT_KV: tl.constexpr = 1,
    KV_INT8: tl.constexpr = False,
):  # fmt: skip
    seq = tl.load(tile_seq_ptr + tl.program_id(0))
    if seq < 0:
        return
    _attention_tile(
        seq, out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        tile_row_ptr, q_end_ptr, seq_len_ptr, scale, softcap, window,
        stride_ot, stride_oh, stride_qt, stride_qh, stride_cs, stride_ch, stride_bt,
        part_ptr, ml_ptr, stride_ms, num_heads, k_scale_ptr, v_scale_ptr, stride_ss, q_ptr,
        PAGE, GROUP, HEAD_DIM, GP, BLOCK_Q, BLOCK_N, BLOCK_D, USE_SOFTCAP, USE_WINDOW,
        SPLIT_KV, KV_INT8, False,
    )  # fmt: skip


@triton.jit
def _paged_attention_sinks_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    tile_seq_ptr, tile_row_ptr, q_end_ptr, seq_len_ptr,
    scale, softcap, window,
    stride_ot, stride_oh, stride_qt, stride_qh, stride_cs, stride_ch, stride_bt,
    part_ptr, ml_ptr, stride_ps, stride_ms, num_heads,
    k_scale_ptr, v_scale_ptr, stride_ss, sinks_ptr,
    PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, SPLIT_KV: tl.constexpr = 1,
    KV_INT8: tl.constexpr = False,
):  # fmt: skip
    """_paged_attention_kernel with a sink logit per query head (gpt-oss): sinks_ptr
    [num_heads] float32."""
    seq = tl.load(tile_seq_ptr + tl.program_id(0))
    if seq < 0:
        return
    _attention_tile(
        seq, out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        tile_row_ptr, q_end_ptr, seq_len_ptr, scale, softcap, window,
        stride_ot, stride_oh, stride_qt, stride_qh, stride_cs, stride_ch, stride_bt,
        part_ptr, ml_ptr, stride_ms, num_heads, k_scale_ptr, v_scale_ptr, stride_ss,
        sinks_ptr, PAGE, GROUP, HEAD_DIM, GP, BLOCK_Q, BLOCK_N, BLOCK_D, USE_SOFTCAP,
        USE_WINDOW, SPLIT_KV, KV_INT8, True,
    )  # fmt: skip


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_ptr, ml_ptr, rows_ptr, stride_ot, stride_oh, stride_ms, num_heads,
    SPLIT_KV: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[tok, head] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s for one (tok, head)."""
    tok = tl.load(rows_ptr + tl.program_id(0))
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < SPLIT_KV
    idx = splits * stride_ms + tok.to(tl.int64) * num_heads + head
    m = tl.load(ml_ptr + idx, mask=s_ok, other=float("-inf"))
    l_s = tl.load(ml_ptr + SPLIT_KV * stride_ms + idx, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok, tl.exp2(m - m_max), 0.0)  # a split that saw no allowed key: m = -inf
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM
    acc = tl.load(
        part_ptr + (idx * BLOCK_D)[:, None] + dims[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    acc = tl.where(w[:, None] > 0.0, acc, 0.0)  # partials of empty splits are never read
    total = tl.sum(w * l_s, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + dims,
        o.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def _tiles(seqs: list[int], query_start_loc: Sequence[int], block_q: int) -> list[list[int]]:
    """[sequence, first row] of each tile of block_q rows."""
    qsl = query_start_loc
    return [[i, r] for i in seqs for r in range(qsl[i], qsl[i + 1], block_q)]


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    plan: TritonAttentionPlan | None = None,
    sinks: torch.Tensor | None = None,
    **launch,
) -> None:
    """Causal attention of each sequence's new queries over its whole cached context.

    Semantics: as reference.paged_attention. For sequence i with query rows
    [qs_i, qs_{i+1}) at positions seq_lens[i] - n_i ... seq_lens[i] - 1,
    out[row] = softmax(softcap(scale * q k^T) masked) v over cached key positions p with
    p <= query position and, with a sliding window W, p > query position - W. The new tokens'
    K/V must already be in the cache (write_kv_cache); with scales (int8 caches) keys and
    values are cache * scale; with sinks, head h's softmax also counts the logit sinks[h],
    whose share multiplies no value. `out` is written in place.

    Shape: as paged_attention_plan, whose launch parameters `launch` passes on, with `plan`
    (the step's, `plan_attention`: the tile lists built and copied to the device once).
    """
    paged_attention_plan(
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
        sliding_window, softcap, k_scale, v_scale, plan=plan, sinks=sinks, **launch,
    )()  # fmt: skip


def plan_attention(query_start_loc: Sequence[int], seq_lens: Sequence[int], num_heads: int,
                   num_kv_heads: int, device: torch.device,
                   decode_block_m: int = 16) -> TritonAttentionPlan:  # fmt: skip
    """The index tensors `paged_attention_plan` needs for one step, on the device: built once
    by the step planner before the forward, so that no layer builds (or copies) anything."""
    gp = triton.next_power_of_2(num_heads // num_kv_heads)
    n_new = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
    decode = [i for i, n in enumerate(n_new) if n == 1]
    prefill = [i for i, n in enumerate(n_new) if n > 1]
    decode_q, prefill_q = max(1, decode_block_m // gp), max(1, PREFILL_BLOCK_M // gp)

    def put(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device)

    def tiles(seqs: list[int], block_q: int) -> torch.Tensor | None:
        return put(_tiles(seqs, query_start_loc, block_q)).T.contiguous() if seqs else None

    return TritonAttentionPlan(
        q_end=put(list(query_start_loc[1:])), seq_lens=put(list(seq_lens)),
        decode_tiles=tiles(decode, decode_q), prefill_tiles=tiles(prefill, prefill_q),
        decode_rows=put([query_start_loc[i] for i in decode]) if decode else None,
        gp=gp, decode_block_q=decode_q, prefill_block_q=prefill_q,
    )  # fmt: skip


def paged_attention_plan(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    decode_block_m: int = 16,
    split_kv: int = 1,
    num_warps: int | None = None,
    num_stages: int | None = None,
    plan: TritonAttentionPlan | None = None,
    sinks: torch.Tensor | None = None,
) -> Callable[[], None]:
    """paged_attention's launches with their tile lists already on the device: the returned
    function only launches kernels (no host work or copies), so it can be timed alone or
    captured in a CUDA graph; it reads the given tensors each time it runs.

    Semantics: as reference.paged_attention. For sequence i with query rows
    [qs_i, qs_{i+1}) at positions seq_lens[i] - n_i ... seq_lens[i] - 1,
    out[row] = softmax(softcap(scale * q k^T) masked) v over cached key positions p with
    p <= query position and, with a sliding window W, p > query position - W. The new tokens'
    K/V must already be in the cache (write_kv_cache). `out` is written in place.

    Shape: out, q [num_tokens, num_heads, head_dim] (last dim contiguous);
    k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] (contiguous);
    block_tables [num_seqs, max_blocks] int; query_start_loc: num_seqs + 1 ints;
    seq_lens: num_seqs ints (context length after this step's tokens);
    k_scale, v_scale [num_blocks, block_size, kv_heads] float16 (contiguous) with int8
    caches, else None; sinks [num_heads] float32 (a logit per head, gpt-oss) or None.

    Launch parameters (speed only): block_n keys per step, decode_block_m rows of a decode
    tile, num_warps, num_stages; split_kv > 1 cuts each decode sequence's keys into that many
    chunks run by separate programs and merged by a second kernel (flash-decoding; changes
    the fp32 summation order only). `plan`: the step's `plan_attention` (the same
    query_start_loc and seq_lens for every layer); a direct call without one (or with one for
    another decode_block_m) builds its own.
    """
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.stride(2) == 1 and out.stride(2) == 1
    kv_int8 = k_scale is not None
    assert kv_int8 == (k_cache.dtype == torch.int8) == (v_scale is not None)
    assert not kv_int8 or (k_scale.is_contiguous() and v_scale.is_contiguous())
    scales = (k_scale, v_scale, k_scale.stride(1)) if kv_int8 else (k_cache, v_cache, 0)
    assert sinks is None or (sinks.shape == (q.shape[1],) and sinks.is_contiguous())
    # Layers with sinks run their own kernel (the same code with the sink logit).
    kernel = _paged_attention_kernel if sinks is None else _paged_attention_sinks_kernel
    extra = () if sinks is None else (sinks,)
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    gp = triton.next_power_of_2(group)
    dev = q.device
    if plan is None or (plan.gp, plan.decode_block_q) != (gp, max(1, decode_block_m // gp)):
        plan = plan_attention(query_start_loc, seq_lens, num_heads, kv_heads, dev, decode_block_m)
    q_end, lens = plan.q_end, plan.seq_lens
    block_d = triton.next_power_of_2(head_dim)
    block_n = block_n or (32 if block_d >= 256 else 64)
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    opts = {key: v for key, v in opts.items() if v is not None}
    launches = []
    # Decode rows want small tiles (M = 16), prefill chunks large ones: one launch each.
    for tiles, block_q, decode in ((plan.decode_tiles, plan.decode_block_q, True),
                                   (plan.prefill_tiles, plan.prefill_block_q, False)):  # fmt: skip
        if tiles is None:
            continue
        splits = split_kv if decode else 1
        part = ml = rows = out  # not read without a split
        stride_ms = 0
        if splits > 1:
            stride_ms = q.shape[0] * num_heads
            part = torch.empty(splits, stride_ms, block_d, dtype=torch.float32, device=dev)
            ml = torch.empty(2, splits, stride_ms, dtype=torch.float32, device=dev)
            rows = plan.decode_rows  # the token row of each decode sequence (its only query)
        n_seqs = 0 if rows is out else rows.shape[0]
        launches.append((tiles, splits, part, ml, rows, stride_ms, block_q, n_seqs))

    def run() -> None:
        for tiles, splits, part, ml, rows, stride_ms, block_q, n_seqs in launches:
            kernel[(tiles.shape[1], kv_heads, splits)](
                out, q, k_cache, v_cache, block_tables,
                tiles[0], tiles[1], q_end, lens,
                float(scale), float(softcap or 0.0), int(sliding_window or 0),
                out.stride(0), out.stride(1), q.stride(0), q.stride(1),
                k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
                part, ml, stride_ms * block_d, stride_ms, num_heads, *scales, *extra,
                PAGE=page, GROUP=group, HEAD_DIM=head_dim,
                GP=gp, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d,
                USE_SOFTCAP=bool(softcap), USE_WINDOW=bool(sliding_window), SPLIT_KV=splits,
                KV_INT8=kv_int8, **opts,
            )  # fmt: skip
            if splits > 1:
                _combine_splits_kernel[(n_seqs, num_heads)](
                    out, part, ml, rows, out.stride(0), out.stride(1), stride_ms, num_heads,
                    SPLIT_KV=splits, BLOCK_S=triton.next_power_of_2(splits),
                    HEAD_DIM=head_dim, BLOCK_D=block_d,
                )  # fmt: skip

    return run
