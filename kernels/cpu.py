"""The engine's CPU backend: every op of `reference.py` with the same signature and
semantics, batched for speed (decode attention of all one-token queries at once, LoRA of many
adapters in a few matmuls). Ops that share work across a step's layers (`paged_attention`,
`lora_apply`) take a plan (kernels/cpu_plan.py) the step planner builds once per step
before the forward (engine/step/step_plan.py); a direct call without one (tools, tests)
plans for itself. Nothing is kept at module level. tests/kernels/test_cpu_backend.py checks
every op against the reference.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from loraplex.kernels.cpu_moe import grouped_mm
from loraplex.kernels.cpu_plan import (
    SHORT_QUERY_ROWS,
    Batched,
    CPUAttentionPlan,
    CPULoRAPlan,
    DecodeGroup,
    Dense,
    fold_mask,
    plan_attention,
    plan_lora,
)
from loraplex.kernels.reference import (
    attend,
    gather_kv,
    int4_matmul,
    int8_matmul,
    sgmv_expand,
    sgmv_shrink,
    sink_softmax,
    visible,
    write_kv_cache,
)

__all__ = [
    "grouped_mm",
    "int4_matmul",
    "int8_matmul",
    "lora_apply",
    "paged_attention",
    "write_kv_cache",
]

# How the CPU path computes attention without a softcap: "sdpa" (torch's fused CPU kernel) or
# "matmul" (two batched matmuls in the input dtype, softmax in float32). Which is faster
# depends on the CPU; the engine measures both once at start (pick_attention_impl).
ATTENTION_IMPLS = ("sdpa", "matmul")


def _attend(q, k, v, q_pos, k_pos, scale, sliding_window, softcap, impl="sdpa", allowed=None,
            sinks=None, folded=None):  # fmt: skip
    """`reference.attend`'s semantics in one of two forms; both accumulate the matmuls in
    float32 and take the softmax in float32:

    - "sdpa": torch's fused attention with a boolean mask; short queries (up to
      `SHORT_QUERY_ROWS` rows a sequence) with their grouped-query heads folded into query
      rows (`_sdpa_folded`), longer ones with sdpa's native GQA;
    - "matmul" (always with a softcap or sinks, which sdpa cannot take): `reference.attend`.
    Which is faster depends on the CPU, by a wide margin either way (docs/cpu-path.md).
    `folded`: `allowed` already folded for the short-query form (`fold_mask`, from a plan).
    """
    if allowed is None:
        allowed = visible(q_pos, k_pos, sliding_window)  # [..., n, L]
    if not softcap and sinks is None and impl == "sdpa":
        if q.shape[-3] <= SHORT_QUERY_ROWS:
            return _sdpa_folded(q, k, v, allowed, scale, folded)
        out = F.scaled_dot_product_attention(
            q.transpose(-3, -2),  # [..., H, n, d]
            k.transpose(-3, -2),  # [..., KVH, L, d]
            v.transpose(-3, -2),
            attn_mask=allowed.unsqueeze(-3),
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(-3, -2)  # [..., n, H, d]
    return attend(
        q, k, v, q_pos, k_pos, scale, sliding_window, softcap, allowed=allowed, sinks=sinks
    )


def _sdpa_folded(q, k, v, allowed, scale, folded=None):
    """torch's fused attention with grouped-query heads folded into query rows.

    q [..., n, H, d]; k, v [..., L, KVH, d]; allowed [..., n, L], boolean or additive in q's
    dtype; `folded`: that mask already as `fold_mask` makes it (a plan's), or None. Returns
    [..., n, H, d].
    The G = H / KVH query heads that read one kv head (head h reads kv head h // G, as in
    transformers' repeat_kv) go in as G * n query rows of that head: [..., KVH, G * n, d].
    sdpa's own `enable_gqa` form is several times slower on the CPU, most of all in bfloat16
    and for one-token queries (the decode rows of a step that also prefills; figures in
    docs/cpu-path.md, `python -m benchmarks.cpu_micro gqa`). `_attend` keeps `enable_gqa`
    for longer queries (prefill chunks): there the two take about as long, and folding
    copies the mask G times."""
    *lead, n, h, d = q.shape
    kvh = k.shape[-2]
    g = h // kvh
    qf = q.transpose(-3, -2).reshape(*lead, kvh, g * n, d)
    if folded is not None:
        mask = folded
    elif g > 1 and n > 1:
        mask = fold_mask(allowed, g)
    else:
        mask = allowed.unsqueeze(-3)  # [..., 1, n, L]: one query row broadcasts over G
    out = F.scaled_dot_product_attention(
        qf, k.transpose(-3, -2), v.transpose(-3, -2), attn_mask=mask, scale=scale
    )  # [..., KVH, G * n, d]
    return out.view(*lead, h, n, d).transpose(-3, -2)


def _decode_matmul(q, k, v, allowed, scale, softcap, sinks=None):
    """`_attend`'s "matmul" form for one query per sequence, as two plain batched matmuls.

    q [B, H, d]; k, v [B * KVH, L, d] (`DecodeGroup.gather`); allowed [B, 1, L];
    sinks [H] or None. Returns [B, H, d]. With keys laid out [B * KVH, L, d], q k^T reads k
    transposed in place: the general form's batch folding copied it element by element,
    which took most of its time (docs/cpu-path.md).
    """
    b, h, d = q.shape
    kvh, length = k.shape[0] // b, k.shape[1]
    g = h // kvh
    scores = torch.bmm(q.reshape(b * kvh, g, d), k.mT).float() * scale  # [B * KVH, G, L]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(b, kvh * g, length).masked_fill(~allowed, float("-inf"))
    p = sink_softmax(scores, None if sinks is None else sinks.view(1, h, 1))
    p = p.to(v.dtype).view(b * kvh, g, length)
    return torch.bmm(p, v).view(b, h, d)


def pick_attention_impl(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    batch: int = 32,
    context: int = 256,
    repeats: int = 5,
    block_size: int = 16,
) -> dict[str, float]:
    """Milliseconds of one decode step (`batch` sequences, one new token each, over `context`
    keys in a paged cache) through `paged_attention` with each impl on this CPU, fastest first
    (the engine keeps the winner in its KernelBackend). Each form is timed as a step runs it,
    its gathers from the cache included: the two gather differently (whole blocks for sdpa,
    rows in head order for matmul), which weighs as much as the attention itself."""
    g = torch.Generator().manual_seed(0)
    nb = -(-context // block_size)
    shape = (batch * nb, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    tables = torch.randperm(batch * nb, generator=g).view(batch, nb)
    q = torch.randn(batch, num_heads, head_dim, generator=g).to(dtype)
    out = torch.empty_like(q)
    qsl = list(range(batch + 1))
    lens = torch.randint(context // 2, context + 1, (batch,), generator=g).tolist()
    plan = plan_attention(tables, qsl, lens, block_size, (None,), (num_kv_heads,), dtype)
    scale = head_dim**-0.5
    times = {}
    for impl in ATTENTION_IMPLS:
        runs = []
        for _ in range(repeats + 1):  # the first run warms up
            start = time.perf_counter()
            paged_attention(out, q, k_cache, v_cache, tables, qsl, lens, scale, plan=plan,
                            impl=impl)  # fmt: skip
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
    *,
    plan: CPUAttentionPlan | None = None,
    sinks: torch.Tensor | None = None,
    impl: str = "sdpa",
) -> torch.Tensor:
    """`reference.paged_attention`, returning `out`; `out` None: the result [T, H, d] in a
    tensor of its own (a one-token decode step's is sdpa's or bmm's output, not copied);
    `plan`: the step's (`plan_attention`, see the module doc); `impl`: the attention form
    (sdpa | matmul). Layers with sinks run the "matmul" form (sdpa cannot take them)."""
    ks, vs, dt = (k_scale, v_scale, q.dtype)
    dev = q.device
    if plan is None:
        plan = plan_attention(block_tables, query_start_loc, seq_lens, k_cache.shape[1])
    plan, short = plan.decode, plan.short
    if plan.whole and k_scale is None and not softcap and sinks is None:
        lean = impl == "sdpa" or (
            q.dtype == torch.float32 and (sliding_window, k_cache.shape[2]) in plan.bias
        )
        if lean:
            return _decode_lean(out, q, k_cache, v_cache, plan, scale, sliding_window, impl)
    if out is None:
        out = q.new_empty(q.shape)
    decode = plan.seqs + short.seqs
    if plan.seqs:
        # All one-token queries at once, padded to the longest context's whole blocks.
        allowed = plan.mask(sliding_window)  # [B, 1, L]
        if softcap or sinks is not None or impl == "matmul":
            k, v = plan.gather(k_cache, ks, dt), plan.gather(v_cache, vs, dt)  # [B * KVH, L, d]
            o = _decode_matmul(q[plan.rows], k, v, allowed, scale, softcap, sinks)
        else:
            k = gather_kv(k_cache, plan.tables, plan.max_len, ks, dt)  # [B, L, KVH, d]
            v = gather_kv(v_cache, plan.tables, plan.max_len, vs, dt)
            additive = plan.masks4.get(sliding_window)
            if additive is not None and additive.dtype == dt:
                allowed = additive.squeeze(1)  # [B, 1, L]: 0 / -inf
            o = _attend(q[plan.rows].unsqueeze(1), k, v, plan.q_pos, plan.k_pos, scale,
                        sliding_window, softcap, impl, allowed=allowed).squeeze(1)  # fmt: skip
        # Padding keys sit beyond each sequence's length, which causality already masks.
        out[plan.rows] = o.to(out.dtype)
    if short.seqs:
        # A few new rows per sequence (a token and its proposals): padded to [B, n] queries
        # (a padding row repeats its sequence's last one, same result) in one batched call.
        k = gather_kv(k_cache, short.tables, short.max_len, ks, dt)  # [B, L, KVH, d]
        v = gather_kv(v_cache, short.tables, short.max_len, vs, dt)
        o = _attend(
            q[short.rows],
            k,
            v,
            short.q_pos,
            short.k_pos,
            scale,
            sliding_window,
            softcap,
            impl,
            allowed=short.mask(sliding_window),
            sinks=sinks,
            folded=short.folded.get((sliding_window, q.shape[1] // k_cache.shape[2])),
        )  # [B, n, H, d] fmt: skip
        out[short.rows.flatten()] = o.flatten(0, 1).to(out.dtype)
    decode_set = set(decode)
    for i in range(len(seq_lens)):
        if i in decode_set:
            continue
        s, e, length = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
        nb = -(-length // k_cache.shape[1])
        k = gather_kv(k_cache, block_tables[i, :nb], length, ks, dt)
        v = gather_kv(v_cache, block_tables[i, :nb], length, vs, dt)
        q_pos = torch.arange(length - (e - s), length, device=dev)
        k_pos = torch.arange(length, device=dev)
        o = _attend(q[s:e], k, v, q_pos, k_pos, scale, sliding_window, softcap, impl, sinks=sinks)
        out[s:e] = o.to(out.dtype)
    return out


def _decode_lean(out, q, k_cache, v_cache, plan: DecodeGroup, scale: float,
                 sliding_window: int | None, impl: str) -> torch.Tensor:  # fmt: skip
    """A step in which every sequence decodes one token (row b is sequence b), float cache,
    no softcap or sinks: `paged_attention`'s decode branch in the fewest ops, from what the
    step's plan built once for every layer (flat block tables, masks per window, additive
    masks per window and kv-head count). Same arithmetic as the general branch: "matmul"
    scores q k^T scaled and masked in float32 (the mask added as 0 / -inf), softmax, times v;
    "sdpa" torch's fused kernel with the boolean mask. Returns `out`, or with `out` None the
    kernel's own output seen as [B, H, d] (sdpa's and bmm's are contiguous in that order)."""
    nblocks, bs, kvh, d = k_cache.shape
    b, h = q.shape[0], q.shape[1]
    length = plan.max_len
    if impl == "matmul":
        bias = plan.bias[(sliding_window, kvh)]
        if kvh == 1:
            k = torch.index_select(k_cache, 0, plan.flat_tables).view(b, length, d)
            v = torch.index_select(v_cache, 0, plan.flat_tables).view(b, length, d)
        else:
            rows = plan.kv_rows[kvh]
            k = torch.index_select(k_cache.view(-1, d), 0, rows).view(b * kvh, length, d)
            v = torch.index_select(v_cache.view(-1, d), 0, rows).view(b * kvh, length, d)
        qg = q.reshape(b * kvh, h // kvh, d)
        scores = torch.baddbmm(bias, qg, k.mT, alpha=scale)  # [B * KVH, G, L]
        if out is None:
            return torch.bmm(scores.softmax(-1), v).view(b, h, d)
        torch.bmm(scores.softmax(-1), v, out=out.view(b * kvh, h // kvh, d))
        return out
    mask = plan.masks4.get(sliding_window)
    if mask is None or mask.dtype != q.dtype:
        mask = plan.mask(sliding_window).unsqueeze(1)
    # The gathered blocks [B * nb, bs, KVH, d] seen as [B, KVH, L, d]: one strided view each,
    # where view + transpose take three ops. The G query heads that share a kv head go in as
    # G query rows of that head ([B, KVH, G, d]; query head h reads kv head h // G, as
    # enable_gqa would have it): each row's attention is the same, and the fused kernel takes
    # G rows per (sequence, kv head) instead of one per (sequence, head), about twice as fast
    # for one-token queries (docs/step-overhead-kernels.md).
    kv_shape, kv_strides = (b, kvh, length, d), (length * kvh * d, d, kvh * d, 1)
    k = torch.index_select(k_cache, 0, plan.flat_tables).as_strided(kv_shape, kv_strides)
    v = torch.index_select(v_cache, 0, plan.flat_tables).as_strided(kv_shape, kv_strides)
    g = h // kvh
    q4 = q.as_strided((b, kvh, g, d), (q.stride(0), g * q.stride(1), q.stride(1), q.stride(2)),
                      q.storage_offset())  # fmt: skip
    o = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale)
    if out is None:
        return o.view(b, h, d)
    out.view(b, kvh, g, d).copy_(o)
    return out


def _slot_weights(w: torch.Tensor, batched: Batched, width: int) -> torch.Tensor:
    """The segments' slots' first `width` rows of a [slots, W, features] stack: a view where
    the slots are consecutive, else a gathered copy."""
    if batched.slots is not None:
        lo, hi = batched.slots
        w = w if (lo, hi) == (0, w.shape[0]) else w[lo:hi]
        return w if width == w.shape[1] else w[:, :width]
    return w[:, :width].index_select(0, batched.slot_index)


def _stacked(w: torch.Tensor, dense: Dense, width: int) -> torch.Tensor:
    """w[slots, :width] as [S * width, features]: a view where the slots are consecutive and
    the width all of w's, else a copy."""
    if dense.run is not None and width == w.shape[1]:
        return w[dense.run[0] : dense.run[1]].view(-1, w.shape[2])
    return w[:, :width].index_select(0, dense.slots).reshape(-1, w.shape[2])


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    widths: Sequence[int],
    *,
    plan: CPULoRAPlan | None = None,
    lora_a_t: torch.Tensor | None = None,
    slot_views: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
) -> None:
    """`reference.lora_apply`: y += per-segment LoRA delta (shrink then expand). `lora_a_t`:
    lora_a.mT, if the caller keeps it (one view fewer per call); `slot_views`: lora_a_t[s]
    and lora_b[s] for every slot s, if the caller keeps them (a group of rows on one adapter
    then selects nothing).

    Segments are taken in groups of one width. A group of few adapters runs dense
    (`DENSE_MAX_COLUMNS`). Otherwise the short segments of similar length (the decode rows
    of many adapters, even beside a few prefill chunks) are padded to one length and run as
    two batched matmuls over the slots' weights instead of two matmuls per segment; the long
    ones run one by one (`plan`: `plan_lora`'s, see the module doc). A group reads exactly
    its width's rows of its own slots, so rows past a slot's width and slots no row uses
    (they may hold anything) are never read. The dense run zeroes the other slots' columns
    with a select, not a product, so it stays exact even when a row's product with another
    adapter overflows (adapters are checked finite when they load). Timings: docs/cpu-path.md.
    """
    if plan is None:
        plan = plan_lora(segments, widths, x.device)
    for group in plan.groups:
        width, segs, index = group.width, group.segments, group.form
        if index is None:
            sgmv_expand(y, sgmv_shrink(x, lora_a, segs, widths), lora_b, segs, widths)
            continue
        if isinstance(index, Dense):
            whole = index.lo == 0 and index.hi == x.shape[0]
            xs, ys = (x, y) if whole else (x[index.lo : index.hi], y[index.lo : index.hi])
            if index.only is not None:  # the slot's own A^T and B, kept views if any
                slot = index.only
                if slot_views is not None and width == lora_a.shape[1]:
                    a_t, b = slot_views[0][slot], slot_views[1][slot]
                else:
                    a_t, b = lora_a[slot, :width].T, lora_b[slot, :width]
                ys.addmm_(xs.mm(a_t), b)
                continue
            t = F.linear(xs, _stacked(lora_a, index, width))
            ys.addmm_(torch.where(index.mask, t, index.zero), _stacked(lora_b, index, width))
            continue
        whole = index.slots == (0, lora_a.shape[0]) and width == lora_a.shape[1]
        a_t = lora_a_t if whole and lora_a_t is not None else _slot_weights(lora_a, index, width).mT
        b = _slot_weights(lora_b, index, width)  # [S, w, out]
        if index.rows is not None:  # equal segments back to back: views, no gather
            r0, length = index.rows
            n = a_t.shape[0] * length
            xs = (x if n == x.shape[0] else x[r0 : r0 + n]).view(-1, length, x.shape[1])
            ys = (y if n == y.shape[0] else y[r0 : r0 + n]).view(-1, length, y.shape[1])
            ys.baddbmm_(torch.bmm(xs, a_t), b)
            continue
        rows, flat_rows, valid = index.index
        delta = torch.bmm(torch.bmm(x[rows], a_t), b)  # [S, L, out]
        y.index_add_(0, flat_rows, delta[valid])


# ------------------------------------------------------------------ graph-ready decode
# Decode steps replayed from persistent buffers (engine/step/graph_runner.py) read only tensors of
# fixed shapes: no Python list of the step's lengths or segments, no host read. These forms
# are plain torch (any device), so a CUDA graph can capture them.


def decode_attention_static(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
    impl: str = "sdpa",
) -> None:
    """One query per row: row b (its token at position seq_lens[b] - 1) attends to its
    sequence's keys through block_tables[b] ([B, max_blocks], every block gathered, the keys
    past seq_lens[b] masked). q, out [B, H, d]; seq_lens [B] int64 (at least 1 each)."""
    b, nb = block_tables.shape
    length = nb * k_cache.shape[1]
    k = gather_kv(k_cache, block_tables, length, k_scale, q.dtype)  # [B, L, KVH, d]
    v = gather_kv(v_cache, block_tables, length, v_scale, q.dtype)
    q_pos = (seq_lens - 1).unsqueeze(1)  # [B, 1]
    k_pos = torch.arange(length, device=q.device)
    allowed = visible(q_pos, k_pos, sliding_window)  # [B, 1, L]
    o = _attend(q.unsqueeze(1), k, v, q_pos, k_pos, scale, sliding_window, softcap, impl,
                allowed=allowed, sinks=sinks)  # fmt: skip
    out.copy_(o.squeeze(1).to(out.dtype))


def lora_apply_static(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
) -> None:
    """y += each row's slot's B A x (row_slots [rows] int64, -1: none): every slot's columns
    in one matmul, the other slots' zeroed per row (a select, so a product that overflows in
    another slot's columns cannot leak), one matmul back. Slots' unused widths are zeros."""
    s, w, _ = lora_a.shape
    t = F.linear(x, lora_a.reshape(s * w, -1))  # [rows, S * W]
    own = row_slots.unsqueeze(1) == torch.arange(s, device=x.device).repeat_interleave(w)
    t = torch.where(own, t, t.new_zeros(()))
    y.addmm_(t, lora_b.reshape(s * w, -1))
