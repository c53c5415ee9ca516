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
blocks that were never written are never read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    tile_seq_ptr, tile_row_ptr, q_end_ptr, seq_len_ptr,
    scale, softcap, window,
    stride_ot, stride_oh, stride_qt, stride_qh, stride_cs, stride_ch, stride_bt,
    PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
):  # fmt: skip
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    if seq < 0:
        return
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
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        block = tl.load(table + k_pos // PAGE, mask=k_ok, other=0)
        slot = block.to(tl.int64) * PAGE + k_pos % PAGE
        kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
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
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def _tiles(seqs: list[int], query_start_loc: Sequence[int], block_q: int) -> list[list[int]]:
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
) -> None:
    """Causal attention of each sequence's new queries over its whole cached context.

    Semantics: as reference.paged_attention. For sequence i with query rows
    [qs_i, qs_{i+1}) at positions seq_lens[i] - n_i ... seq_lens[i] - 1,
    out[row] = softmax(softcap(scale * q k^T) masked) v over cached key positions p with
    p <= query position and, with a sliding window W, p > query position - W. The new tokens'
    K/V must already be in the cache (write_kv_cache). `out` is written in place.

    Shape: out, q [num_tokens, num_heads, head_dim] (last dim contiguous);
    k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] (contiguous);
    block_tables [num_seqs, max_blocks] int; query_start_loc: num_seqs + 1 ints;
    seq_lens: num_seqs ints (context length after this step's tokens).
    """
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.stride(2) == 1 and out.stride(2) == 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    gp = triton.next_power_of_2(group)
    dev = q.device
    num_seqs = len(seq_lens)
    q_end = torch.tensor(query_start_loc[1:], dtype=torch.int32).to(dev)
    lens = torch.tensor(list(seq_lens), dtype=torch.int32).to(dev)
    n_new = [query_start_loc[i + 1] - query_start_loc[i] for i in range(num_seqs)]
    # Decode rows want small tiles (M = 16), prefill chunks large ones: one launch each.
    decode = [i for i in range(num_seqs) if n_new[i] == 1]
    prefill = [i for i in range(num_seqs) if n_new[i] > 1]
    block_d = triton.next_power_of_2(head_dim)
    block_n = 32 if block_d >= 256 else 64
    for seqs, block_m in ((decode, 16), (prefill, 64)):
        if not seqs:
            continue
        block_q = max(1, block_m // gp)
        tiles = torch.tensor(_tiles(seqs, query_start_loc, block_q), dtype=torch.int32)
        tiles = tiles.T.contiguous().to(dev)  # [2, num_tiles]: sequence, first row
        _paged_attention_kernel[(tiles.shape[1], kv_heads)](
            out, q, k_cache, v_cache, block_tables,
            tiles[0], tiles[1], q_end, lens,
            float(scale), float(softcap or 0.0), int(sliding_window or 0),
            out.stride(0), out.stride(1), q.stride(0), q.stride(1),
            k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            PAGE=page, GROUP=group, HEAD_DIM=head_dim,
            GP=gp, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d,
            USE_SOFTCAP=bool(softcap), USE_WINDOW=bool(sliding_window),
        )  # fmt: skip
