"""Torch reference of every kernel op: the oracle the kernels are tested against.

Each op is written for clarity, one sequence or segment at a time; the engine's CPU path is
`cpu.py` (the same semantics, batched), checked against these in tests/kernels.

Layouts shared with the Triton kernels:

    KV cache (per layer)     k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
        int8 KV cache        the same caches in int8, plus k_scale, v_scale
                             [num_blocks, block_size, num_kv_heads] float16: one symmetric
                             scale per token per head, value = int8 * scale
                             (quantize_kv; head_dim 64: 66 bytes a row instead of 128 in bf16)
    slot of token position p of a sequence:   block_table[p // block_size] * block_size
                                              + p % block_size
    LoRA slots (per layer, per fused group such as q|k|v):
        lora_a [num_slots, max_width, in_features]    rows   w0:w0+r_i   = A_i        (slice i)
        lora_b [num_slots, max_width, out_features]   rows   w0:w0+r_i,
                                                      cols   off_i:off_i+n_i = (scale_i*B_i)^T
    i.e. the slices of one adapter sit side by side in the rank dimension (no padding to the
    maximum rank) and B is block-diagonal over the slices, with the scale folded in.
    DoRA (per module)
        lora_dora [num_slots + 1, out_features]       m / ||W + B A||_row of the slot's
                                                      adapter (ones without DoRA; the last
                                                      row, slot -1's, stays ones)
        lora_dora_shift  same shape, or None          (1 - lora_dora) * bias
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: scale = float16(max|x| / 127) over the last dim; q = floor(x / scale + 0.5)
    clamped to [-127, 127] (scale 0: q = 0). Dequantized: q * scale.

    Shape: x [..., head_dim] -> q [..., head_dim] int8, scale [...] float16.
    """
    x = x.float()
    scale = (x.abs().amax(-1) / 127.0).to(torch.float16)
    s = scale.float()
    s = torch.where(s == 0.0, 1.0, s).unsqueeze(-1)
    # floor(+0.5) rather than round-half-even: the Triton kernel has no rint in interpret mode
    q = torch.floor(x / s + 0.5).clamp(-127.0, 127.0).to(torch.int8)
    return q, scale


def write_kv_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Semantics: cache.flat[slot_mapping[t]] = kv[t]; caches changed in place. With scales
    (int8 caches): cache.flat[slot], scale.flat[slot] = quantize_kv(kv[t]).

    Shape: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim];
    k, v [num_tokens, kv_heads, head_dim]; slot_mapping [num_tokens] int64;
    k_scale, v_scale [num_blocks, block_size, kv_heads] float16 or None.
    """
    if k_scale is None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
        return
    for cache, scale, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        q, s = quantize_kv(x)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, q)
        scale.view(-1, scale.shape[2]).index_copy_(0, slot_mapping, s)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 cache rows times their scales: q [..., d] int8, scale [...]; in float32, rounded
    once to the compute dtype."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    # block_table [..., nb] -> [..., length, kv_heads, d]; index_select copies whole blocks,
    # which the CPU does faster than advanced indexing's per-element gather (docs/cpu-path.md).
    # With a scale: dequantized to dtype.
    flat = block_table.reshape(-1)
    blocks = torch.index_select(cache, 0, flat)  # [prod(...) * nb, bs, ...]
    if scale is not None:
        blocks = dequantize(blocks, torch.index_select(scale, 0, flat), dtype)
    shape = (*block_table.shape[:-1], block_table.shape[-1] * cache.shape[1], *cache.shape[2:])
    return blocks.view(shape)[..., :length, :, :]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None):
    """Key j is visible to query i when k_pos[j] <= q_pos[i] (and, with a sliding window W,
    k_pos[j] > q_pos[i] - W). q_pos [..., n], k_pos [L] -> bool [..., n, L]."""
    allowed = k_pos <= q_pos.unsqueeze(-1)
    if sliding_window:
        allowed &= k_pos > q_pos.unsqueeze(-1) - sliding_window
    return allowed


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over [scores..., sink] with the sink's probability dropped (gpt-oss attention
    sinks: the sink takes probability mass but multiplies no value), in float32.

    Shape: scores [..., L] float32; sinks broadcastable to [..., 1] or None (plain softmax).
    """
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1]


def attend(q, k, v, q_pos, k_pos, scale, sliding_window, softcap, allowed=None, sinks=None):
    """q [..., n, H, d]; k, v [..., L, KVH, d]; q_pos [..., n]; k_pos [L]; sinks [H] or None
    -> [..., n, H, d].

    Scores q k^T in the input dtype (rounded to it, as transformers' eager attention does),
    scale / softcap / mask / softmax in float32 (with a sink logit per head: `sink_softmax`),
    then probabilities (input dtype) times v. Runs over [..., KVH, G*n, d], so K/V are never
    repeated per query head.
    """
    if allowed is None:
        allowed = visible(q_pos, k_pos, sliding_window)  # [..., n, L]
    n, h, kvh = q.shape[-3], q.shape[-2], k.shape[-2]
    g = h // kvh
    q = q.unflatten(-2, (kvh, g)).movedim(-4, -2).flatten(-3, -2)  # [..., KVH, G*n, d]
    k, v = k.movedim(-2, -3), v.movedim(-2, -3)  # [..., KVH, L, d]
    scores = (q @ k.transpose(-1, -2)).float() * scale  # [..., KVH, G*n, L]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.unflatten(-2, (g, n)).masked_fill(
        ~allowed.unsqueeze(-3).unsqueeze(-3), float("-inf")
    )  # [..., KVH, G, n, L]
    if sinks is not None:
        sinks = sinks.view(kvh, g, 1, 1)  # head h = kv_head * G + g
    out = sink_softmax(scores, sinks).flatten(-3, -2).to(v.dtype) @ v  # [..., KVH, G*n, d]
    return out.unflatten(-2, (g, n)).movedim(-2, -4).flatten(-3, -2)  # [..., n, H, d]


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
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of each sequence's new queries over its whole cached context.

    Semantics: for sequence i with query rows [qs_i, qs_{i+1}) at positions
    seq_lens[i] - n_i ... seq_lens[i] - 1, out[row] = softmax(scale * q k^T [masked]) v over
    key positions 0..seq_lens[i]-1 that are <= the query position and, with a sliding window
    W, > query position - W. With scales (int8 caches) keys and values are
    cache * scale, computed in q's dtype. With sinks (gpt-oss), head h's softmax runs over
    [scores..., sinks[h]] and the sink's share is dropped: out = sum_j p_j v_j with
    p_j = e^{s_j} / (sum_j' e^{s_j'} + e^{sinks[h]}), the keys those the mask (window
    included) leaves. `out` is written in place.

    Shape: out, q [num_tokens, num_heads, head_dim]; k_cache, v_cache, k_scale, v_scale as
    in write_kv_cache; block_tables [num_seqs, max_blocks] int64; query_start_loc:
    num_seqs + 1 ints; seq_lens: num_seqs ints (context length after this step's tokens);
    sinks [num_heads] float32 (a logit per head) or None.
    """
    ks, vs, dt, dev = k_scale, v_scale, q.dtype, q.device
    for i, length in enumerate(seq_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        nb = -(-length // k_cache.shape[1])
        k = gather_kv(k_cache, block_tables[i, :nb], length, ks, dt)
        v = gather_kv(v_cache, block_tables[i, :nb], length, vs, dt)
        q_pos = torch.arange(length - (e - s), length, device=dev)
        k_pos = torch.arange(length, device=dev)
        o = attend(q[s:e], k, v, q_pos, k_pos, scale, sliding_window, softcap, sinks=sinks)
        out[s:e] = o.to(out.dtype)


def sgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    widths: Sequence[int],
) -> list[torch.Tensor | None]:
    """Semantics: t_j = x[s_j:e_j] @ lora_a[slot_j, :widths[slot_j]]^T for each segment j.

    Rows of a segment share one adapter slot; a slot < 0 (no adapter) or width 0 gives None
    and reads no weights.

    Shape: x [num_tokens, in]; lora_a [num_slots, max_width, in]; segments: (start, end, slot);
    widths: per slot. Returns per segment [e_j - s_j, widths[slot_j]] or None.
    """
    out: list[torch.Tensor | None] = []
    for s, e, slot in segments:
        w = widths[slot] if slot >= 0 else 0
        out.append(F.linear(x[s:e], lora_a[slot, :w]) if w else None)
    return out


def sgmv_expand(
    y: torch.Tensor,
    t: Sequence[torch.Tensor | None],
    lora_b: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    widths: Sequence[int],
) -> None:
    """Semantics: y[s_j:e_j] += t_j @ lora_b[slot_j, :widths[slot_j]]; y changed in place.

    Shape: y [num_tokens, out]; t_j [e_j - s_j, widths[slot_j]];
    lora_b [num_slots, max_width, out] (scale folded in).
    """
    for (s, e, slot), tj in zip(segments, t, strict=True):
        if tj is not None:
            y[s:e].addmm_(tj, lora_b[slot, : widths[slot]])


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    widths: Sequence[int],
) -> None:
    """y += per-segment LoRA delta: sgmv_expand(y, sgmv_shrink(x, ...), ...); y in place.

    Shape: y [num_tokens, out]; x [num_tokens, in]; lora_a [num_slots, max_width, in];
    lora_b [num_slots, max_width, out]; segments (start, end, slot); widths per slot.
    """
    sgmv_expand(y, sgmv_shrink(x, lora_a, segments, widths), lora_b, segments, widths)


def dora_apply(
    y: torch.Tensor,
    factor: torch.Tensor,
    shift: torch.Tensor | None,
    slots: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """DoRA after the LoRA delta: y[r] = bias + factor[s] * (y[r] - bias) for each given row r
    of slot s, as y[r] * factor[s] + shift[s]; y (base output + bias + LoRA delta) in place.

    Shape: y [num_tokens, out]; factor, shift [num_slots + 1, out] (shift None: no bias);
    slots [n] int64 (-1 indexes the last row: ones, so such rows keep their values exactly);
    rows [n] int64 (None: every row, n = num_tokens). Plain indexing, no host sync: graph-safe.
    """
    f = factor[slots]
    if rows is None:
        y.mul_(f)
        if shift is not None:
            y.add_(shift[slots])
        return
    part = y.index_select(0, rows).mul_(f)
    if shift is not None:
        part.add_(shift[slots])
    y.index_copy_(0, rows, part)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Semantics: W[n, k] = qweight[n, k] * scales[n].

    Shape: qweight int8 [N, K]; scales float [N]. Returns float32 [N, K].
    """
    return qweight.float() * scales.float().unsqueeze(1)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Byte j of row n holds column 2j (low nibble) and 2j + 1 (high nibble).

    Shape: qweight uint8 [N, K // 2]. Returns int16 [N, K] with values in [0, 15].
    """
    q = qweight.to(torch.int16)
    return torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """Semantics: W[n, k] = (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G].

    Shape: qweight uint8 [N, K // 2]; scales, zeros float [N, K // G]. Returns float32 [N, K].
    """
    q = unpack_int4(qweight).float()  # [N, K]
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    return (q - 8.0) * s + z


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Weight-only int8 linear, per-output-channel symmetric scales.

    Semantics: y = x @ W^T with W[n, k] = qweight[n, k] * scales[n].

    Shape: x [M, K] fp16/bf16/fp32; qweight int8 [N, K] (nn.Linear orientation);
    scales float [N]. Returns y [M, N] in x's dtype.
    """
    # Scaling after the matmul is exact per output channel and keeps W in x's dtype range.
    y = F.linear(x.float(), qweight.float()) * scales.float()
    return y.to(x.dtype)


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int = 128,
) -> torch.Tensor:
    """Weight-only int4 linear, asymmetric group-wise along K (group G, K % G == 0).

    Semantics: y = x @ W^T with W[n, k] = (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G],
    q[n, 2j] = qweight[n, j] & 0xF and q[n, 2j + 1] = qweight[n, j] >> 4.

    Shape: x [M, K] fp16/bf16/fp32; qweight uint8 [N, K // 2]; scales, zeros float [N, K // G].
    Returns y [M, N] in x's dtype.
    """
    w = dequantize_int4(qweight, scales, zeros, group_size)  # [N, K] fp32
    return F.linear(x.float(), w).to(x.dtype)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped matmul of rows sorted by group (mixture-of-experts; torch._grouped_mm with 2-D
    x and 3-D w).

    Semantics: y[offs[g-1]:offs[g]] = x[offs[g-1]:offs[g]] @ w[g] (offs[-1] = 0), in float32,
    rounded once to x's dtype; groups may be empty. Rows from offs[G-1] on are unspecified
    (zero here).

    Shape: x [P, K]; w [G, K, N] (any strides); offs [G] int32 cumulative row ends,
    non-decreasing, offs[G-1] <= P. Returns y [P, N] in x's dtype.
    """
    y = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            y[start:end] = (x[start:end].float() @ w[g].float()).to(x.dtype)
        start = end
    return y
