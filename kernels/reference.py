"""Torch reference of every kernel op: the oracle for kernel tests and the engine's CPU path.

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
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

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


def _dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # q [..., d] int8, scale [...]: in float32, rounded once to the compute dtype
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def _gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    # block_table [..., nb] -> [..., length, kv_heads, d]; index_select copies whole blocks
    # (~2.3x faster than advanced indexing on the CPU). With a scale: dequantized to dtype.
    flat = block_table.reshape(-1)
    blocks = torch.index_select(cache, 0, flat)  # [prod(...) * nb, bs, ...]
    if scale is not None:
        blocks = _dequantize(blocks, torch.index_select(scale, 0, flat), dtype)
    shape = (*block_table.shape[:-1], block_table.shape[-1] * cache.shape[1], *cache.shape[2:])
    return blocks.view(shape)[..., :length, :, :]


# How _attend computes attention without a softcap: "sdpa" (torch's fused CPU kernel) or
# "matmul" (two batched matmuls in the input dtype, softmax in float32). Which is faster
# depends on the CPU; the engine measures both once at start (pick_attention_impl).
ATTENTION_IMPLS = ("sdpa", "matmul")
_attention_impl = "sdpa"


def set_attention_impl(impl: str) -> None:
    """Select how the reference computes attention (sdpa | matmul) for every later call."""
    global _attention_impl
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, not {impl!r}")
    _attention_impl = impl


def get_attention_impl() -> str:
    return _attention_impl


def _attend(q, k, v, q_pos, k_pos, scale, sliding_window, softcap, impl=None, allowed=None):
    """q [..., n, H, d]; k, v [..., L, KVH, d]; q_pos [..., n]; k_pos [L].

    Key j is visible to query i when k_pos[j] <= q_pos[i] (and, with a sliding window W,
    k_pos[j] > q_pos[i] - W). Both forms accumulate the matmuls in float32 and take the
    softmax in float32:

    - "sdpa": torch's fused attention with a boolean mask and native GQA. On a 2-core Xeon
      with AMX it beat a float32-upcast matmul form by up to 10x (bf16 decode batch of 64,
      8/2 heads, d 64: 0.84 vs 8.3 ms).
    - "matmul" (always with a softcap): scores q k^T in the input dtype (rounded to it, as
      transformers' eager attention does), scale / softcap / mask / softmax in float32, then
      probabilities (input dtype) times v. Runs over [..., KVH, G*n, d], so K/V are never
      repeated per query head. On a 2-core AMD EPYC without AMX, bf16: 0.43 vs 4.8 ms for
      that decode batch at 64 keys, 1.2 vs 18 ms at 256; prefill 1.1-1.8x faster.
    """
    if allowed is None:
        allowed = _visible(q_pos, k_pos, sliding_window)  # [..., n, L]
    if not softcap and (impl or _attention_impl) == "sdpa":
        out = F.scaled_dot_product_attention(
            q.transpose(-3, -2),  # [..., H, n, d]
            k.transpose(-3, -2),  # [..., KVH, L, d]
            v.transpose(-3, -2),
            attn_mask=allowed.unsqueeze(-3),
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(-3, -2)  # [..., n, H, d]
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
    out = scores.softmax(-1).flatten(-3, -2).to(v.dtype) @ v  # [..., KVH, G*n, d]
    return out.unflatten(-2, (g, n)).movedim(-2, -4).flatten(-3, -2)  # [..., n, H, d]


def _decode_matmul(q, k, v, allowed, scale, softcap):
    """`_attend`'s "matmul" form for one query per sequence, as two plain batched matmuls.

    q [B, H, d]; k, v [B * KVH, L, d] (`_DecodePlan.gather`); allowed [B, 1, L].
    Returns [B, H, d]. With keys laid out [B * KVH, L, d], q k^T reads k transposed in place:
    the general form's batch folding copied it element by element, which took most of its
    time (decode batch of 36 over 190 keys, 8/2 heads of 64: 1.7 -> 0.5 ms per layer; 4/1
    heads of 256: 4.3 -> 1 ms).
    """
    b, h, d = q.shape
    kvh, length = k.shape[0] // b, k.shape[1]
    g = h // kvh
    scores = torch.bmm(q.reshape(b * kvh, g, d), k.mT).float() * scale  # [B * KVH, G, L]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(b, kvh * g, length).masked_fill(~allowed, float("-inf"))
    p = scores.softmax(-1).to(v.dtype).view(b * kvh, g, length)
    return torch.bmm(p, v).view(b, h, d)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None):
    allowed = k_pos <= q_pos.unsqueeze(-1)  # [..., n, L]
    if sliding_window:
        allowed &= k_pos > q_pos.unsqueeze(-1) - sliding_window
    return allowed


class _DecodePlan:
    """What every layer's decode attention of one step shares: the one-token sequences, their
    rows, block tables and positions, and the visibility mask per sliding window."""

    def __init__(self, block_tables, query_start_loc, seq_lens, block_size: int, device):
        # A copy of the tables: inference tensors keep no version counter to detect an
        # in-place change, and comparing a [seqs, blocks] int tensor costs microseconds.
        self.key = (block_tables.clone(), tuple(query_start_loc), tuple(seq_lens), block_size)
        self.device = torch.device(device)
        n = len(seq_lens)
        self.decode = [i for i in range(n) if query_start_loc[i + 1] - query_start_loc[i] == 1]
        if not self.decode:
            return
        self.rows = torch.tensor([query_start_loc[i] for i in self.decode], device=device)
        lens = [seq_lens[i] for i in self.decode]
        nb = -(-max(lens) // block_size)
        # Whole blocks are gathered: a contiguous [B, nb * block_size, ...] view of them needs
        # no copy, and the keys past each length are masked by causality.
        self.max_len = nb * block_size
        self.tables = block_tables[self.decode, :nb]
        self.q_pos = (torch.tensor(lens, device=device) - 1).unsqueeze(-1)  # [B, 1]
        self.k_pos = torch.arange(self.max_len, device=device)
        self._masks: dict[int | None, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}  # kv heads -> row indices for gather()

    def matches(self, block_tables, query_start_loc, seq_lens, block_size: int, device) -> bool:
        k = self.key
        return (
            self.device == torch.device(device)
            and k[3] == block_size
            and k[2] == tuple(seq_lens)
            and k[1] == tuple(query_start_loc)
            and k[0].shape == block_tables.shape
            and torch.equal(k[0], block_tables)
        )

    def gather(
        self, cache: torch.Tensor, scale: torch.Tensor | None = None, dtype=None
    ) -> torch.Tensor:
        """The decode sequences' keys (or values) as [B * KVH, L, d], for `_decode_matmul`.

        One kv head: the whole blocks, already in that order. Several: one gather of d-long
        rows straight into that order (row indices built once per step); gathering blocks
        and then moving the head dimension took 3.3 ms instead of 0.4 (64 sequences x 192
        keys, 2 kv heads of 64, blocks spread over a large cache). With a scale (int8
        cache): dequantized to dtype.
        """
        nblocks, bs, kvh, d = cache.shape
        b, length = self.tables.shape[0], self.max_len
        if kvh == 1:
            return _gather_kv(cache, self.tables, length, scale, dtype).view(b, length, d)
        if kvh not in self._rows:
            slots = self.tables.unsqueeze(-1) * bs + torch.arange(bs, device=self.device)
            heads = torch.arange(kvh, device=self.device).view(1, kvh, 1)
            self._rows[kvh] = (slots.view(b, 1, length) * kvh + heads).reshape(-1)
        rows = torch.index_select(cache.view(nblocks * bs * kvh, d), 0, self._rows[kvh])
        if scale is not None:
            scales = torch.index_select(scale.view(-1), 0, self._rows[kvh])
            rows = _dequantize(rows, scales, dtype)
        return rows.view(b * kvh, length, d)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window not in self._masks:
            self._masks[sliding_window] = _visible(self.q_pos, self.k_pos, sliding_window)
        return self._masks[sliding_window]


_last_plan: _DecodePlan | None = None


def _decode_plan(block_tables, query_start_loc, seq_lens, block_size: int, device) -> _DecodePlan:
    """The step's plan, built by the first layer and reused by the others (they pass equal
    metadata; any change in the tables or lengths, even in place, builds a new one)."""
    global _last_plan
    plan, args = _last_plan, (block_tables, query_start_loc, seq_lens, block_size, device)
    if plan is None or not plan.matches(*args):
        plan = _DecodePlan(*args)
        _last_plan = plan
    return plan


def pick_attention_impl(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    batch: int = 32,
    context: int = 256,
    repeats: int = 5,
) -> dict[str, float]:
    """Milliseconds of one decode batch (`batch` queries over `context` keys each) with each
    impl on this CPU, fastest first; the caller sets the winner with set_attention_impl."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, context, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, context, num_kv_heads, head_dim, generator=g).to(dtype)
    q_pos = torch.randint(context // 2, context, (batch, 1), generator=g)
    k_pos = torch.arange(context)
    allowed = _visible(q_pos, k_pos, None)  # [B, 1, L]
    scale = head_dim**-0.5
    k_rows, v_rows = (t.transpose(1, 2).reshape(-1, context, head_dim) for t in (k, v))
    forms = {  # as paged_attention runs a decode batch with each impl
        "sdpa": lambda: _attend(q.unsqueeze(1), k, v, q_pos, k_pos, scale, None, None, "sdpa"),
        "matmul": lambda: _decode_matmul(q, k_rows, v_rows, allowed, scale, None),
    }
    times = {}
    for impl in ATTENTION_IMPLS:
        runs = []
        for _ in range(repeats + 1):  # the first run warms up
            start = time.perf_counter()
            forms[impl]()
            runs.append(time.perf_counter() - start)
        times[impl] = sorted(runs[1:])[len(runs[1:]) // 2] * 1e3
    return dict(sorted(times.items(), key=lambda kv: kv[1]))


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
) -> None:
    """Causal attention of each sequence's new queries over its whole cached context.

    Semantics: for sequence i with query rows [qs_i, qs_{i+1}) at positions
    seq_lens[i] - n_i ... seq_lens[i] - 1, out[row] = softmax(scale * q k^T [masked]) v over
    key positions 0..seq_lens[i]-1 that are <= the query position and, with a sliding window
    W, > query position - W. With scales (int8 caches) keys and values are
    cache * scale, computed in q's dtype. `out` is written in place.

    Shape: out, q [num_tokens, num_heads, head_dim]; k_cache, v_cache, k_scale, v_scale as
    in write_kv_cache; block_tables [num_seqs, max_blocks] int64; query_start_loc:
    num_seqs + 1 ints; seq_lens: num_seqs ints (context length after this step's tokens).
    """
    ks, vs, dt = (k_scale, v_scale, q.dtype)
    dev = q.device
    plan = _decode_plan(block_tables, query_start_loc, seq_lens, k_cache.shape[1], dev)
    decode = plan.decode
    if decode:
        # All one-token queries at once, padded to the longest context's whole blocks.
        allowed = plan.mask(sliding_window)  # [B, 1, L]
        if softcap or _attention_impl == "matmul":
            k, v = plan.gather(k_cache, ks, dt), plan.gather(v_cache, vs, dt)  # [B * KVH, L, d]
            o = _decode_matmul(q[plan.rows], k, v, allowed, scale, softcap)
        else:
            k = _gather_kv(k_cache, plan.tables, plan.max_len, ks, dt)  # [B, L, KVH, d]
            v = _gather_kv(v_cache, plan.tables, plan.max_len, vs, dt)
            o = _attend(q[plan.rows].unsqueeze(1), k, v, plan.q_pos, plan.k_pos, scale,
                        sliding_window, softcap, allowed=allowed).squeeze(1)  # fmt: skip
        # Padding keys sit beyond each sequence's length, which causality already masks.
        out[plan.rows] = o.to(out.dtype)
    decode_set = set(decode)
    for i in range(len(seq_lens)):
        if i in decode_set:
            continue
        s, e, length = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
        nb = -(-length // k_cache.shape[1])
        k = _gather_kv(k_cache, block_tables[i, :nb], length, ks, dt)
        v = _gather_kv(v_cache, block_tables[i, :nb], length, vs, dt)
        q_pos = torch.arange(length - (e - s), length, device=dev)
        k_pos = torch.arange(length, device=dev)
        out[s:e] = _attend(q[s:e], k, v, q_pos, k_pos, scale, sliding_window, softcap).to(out.dtype)


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


def _batchable(segs: list[tuple[int, int, int]]) -> tuple[list, list]:
    """Split one width's segments into (batched, one by one): the shortest segments run
    batched, padded to the longest of them, as long as the padding at most doubles the rows;
    the longer ones (prefill chunks, where a matmul per segment costs little extra) run one
    by one. So a step mixing decode rows of many adapters with a few prefills still batches
    its decode rows."""
    order = sorted(segs, key=lambda seg: seg[1] - seg[0])
    total, cut = 0, 0
    for i, (s, e, _) in enumerate(order):
        total += e - s
        if (i + 1) * (e - s) <= 2 * total:
            cut = i + 1
    if cut < 3:
        return [], segs
    return order[:cut], order[cut:]


# A width group of at most this many adapter columns (slots x width) runs "dense": one
# matmul against every slot's A stacked, the other slots' columns zeroed per row, one matmul
# against the stacked B. It computes (slots) times the LoRA flops but skips the gathers and
# the padded batched matmuls, which cost more at these sizes. Demo-model shapes on a Zen 4
# CPU, bf16, 1 thread, lora_apply of one layer's qkv, o, gate_up and down: 4 adapters x 8
# decode rows 0.96 -> 0.75 ms, x 1 row 0.69 -> 0.47 ms; 8 x 4 and 16 x 2 even (within 5 %);
# 2 adapters x 16 rows (per-segment before) 0.83 -> 0.87 ms; 32 x 1 (768 columns at qkv)
# even, 64 x 1 (1536) dense 30-60 % slower.
DENSE_MAX_COLUMNS = 256


@dataclass(frozen=True)
class _Dense:
    """One width group run dense over rows [lo, hi): `slots` [S] the distinct slots,
    `mask` bool [hi - lo, S * width] (a row keeps its own slot's columns only)."""

    lo: int
    hi: int
    slots: torch.Tensor
    mask: torch.Tensor
    from_zero: bool  # slots are 0, 1, .., S - 1


def _dense(segs: list[tuple[int, int, int]], width: int, device: torch.device) -> _Dense | None:
    slots = sorted({slot for *_, slot in segs})
    if len(slots) * width > DENSE_MAX_COLUMNS:
        return None
    lo, hi = min(s for s, _, _ in segs), max(e for _, e, _ in segs)
    col = {slot: i for i, slot in enumerate(slots)}
    owner = torch.full((hi - lo,), -1, dtype=torch.long)
    for s, e, slot in segs:
        owner[s - lo : e - lo] = col[slot]
    mask = owner.unsqueeze(1) == torch.arange(len(slots)).repeat_interleave(width)
    from_zero = slots == list(range(len(slots)))
    return _Dense(lo, hi, torch.tensor(slots, device=device), mask.to(device), from_zero)


def _lora_groups(
    segments: Sequence[tuple[int, int, int]], widths: Sequence[int], device: torch.device
) -> list[tuple[int, list[tuple[int, int, int]], tuple[torch.Tensor, ...] | _Dense | None]]:
    """`lora_apply`'s plan: per width, a dense run (few adapters: `_Dense`), or the segments
    run one by one (index None) and those run batched, with their index tensors (rows [S, L],
    the valid rows flattened, valid, slots)."""
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for s, e, slot in segments:
        if slot >= 0 and widths[slot]:
            groups.setdefault(widths[slot], []).append((s, e, slot))
    plan = []
    for width, all_segs in groups.items():
        dense = _dense(all_segs, width, device)
        if dense is not None:
            plan.append((width, all_segs, dense))
            continue
        segs, alone = _batchable(all_segs)
        if alone:
            plan.append((width, alone, None))
        if not segs:
            continue
        lens = [e - s for s, e, _ in segs]
        starts = torch.tensor([s for s, _, _ in segs], device=device)
        steps = torch.arange(max(lens), device=device)
        valid = steps < torch.tensor(lens, device=device).unsqueeze(1)  # [S, L]
        # Padding repeats the segment's first row; its results are dropped by `valid`.
        rows = torch.where(valid, starts.unsqueeze(1) + steps, starts.unsqueeze(1))  # [S, L]
        slots = torch.tensor([slot for _, _, slot in segs], device=device)
        plan.append((width, segs, (rows, rows[valid], valid, slots)))
    return plan


# The layers of one step call lora_apply with the same segments (and the same widths per
# module kind): their plans are kept, keyed by value, so each is built once per step.
_PLANS: dict[tuple, list] = {}
_MAX_PLANS = 8


def _stacked(w: torch.Tensor, dense: _Dense, width: int) -> torch.Tensor:
    """w[slots, :width] as [S * width, features]: a view when that is all of w, else a copy."""
    if dense.from_zero and width == w.shape[1] and dense.slots.numel() == w.shape[0]:
        return w.reshape(-1, w.shape[2])
    return w[:, :width].index_select(0, dense.slots).reshape(-1, w.shape[2])


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    widths: Sequence[int],
) -> None:
    """y += per-segment LoRA delta (shrink then expand); see sgmv_shrink / sgmv_expand.

    Segments are taken in groups of one width. A group of few adapters runs dense
    (`DENSE_MAX_COLUMNS`). Otherwise the short segments of similar length (the decode rows
    of many adapters, even beside a few prefill chunks) are padded to one length and run as
    two batched matmuls over the slots' weights instead of two matmuls per segment; the long
    ones run one by one. A group reads exactly its width's rows of its own slots, so rows past
    a slot's width and slots no row uses (they may hold anything) are never read. The dense
    run zeroes the other slots' columns with a select, not a product, so it stays exact even
    when a row's product with another adapter overflows (adapters are checked finite when
    they load). On the CPU, 32 segments of 2 rows (in 512, out 768, width 24, bf16): 0.30 ms
    batched, 1.6 ms per segment; masking the gathered weights instead (one common width)
    took 4.2 ms.
    """
    key = (tuple(segments), tuple(widths[slot] if slot >= 0 else 0 for *_, slot in segments),
           x.device)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _lora_groups(segments, widths, x.device)
    for width, segs, index in plan:
        if index is None:
            sgmv_expand(y, sgmv_shrink(x, lora_a, segs, widths), lora_b, segs, widths)
            continue
        if isinstance(index, _Dense):
            t = F.linear(x[index.lo : index.hi], _stacked(lora_a, index, width))
            t = torch.where(index.mask, t, t.new_zeros(()))
            y[index.lo : index.hi].addmm_(t, _stacked(lora_b, index, width))
            continue
        rows, flat_rows, valid, slots = index
        a = lora_a[:, :width].index_select(0, slots)  # [S, w, in]
        b = lora_b[:, :width].index_select(0, slots)  # [S, w, out]
        delta = torch.bmm(torch.bmm(x[rows], a.transpose(1, 2)), b)  # [S, L, out]
        y.index_add_(0, flat_rows, delta[valid])


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
