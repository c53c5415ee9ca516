"""The engine's CPU backend: every op of `reference.py` with the same signature and
semantics, batched for speed (decode attention of all one-token queries at once, LoRA of many
adapters in a few matmuls). Ops that share work across a step's layers (`paged_attention`,
`lora_apply`) take a `plan` the model runner builds once per step before the forward
(`plan_attention`, `plan_lora`; engine/step/step_plan.py); without one a call plans for itself.
Nothing is kept at module level. tests/kernels/test_cpu_backend.py checks every op against
the reference.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.kernels.reference import (
    attend,
    dequantize,
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


def fold_mask(allowed: torch.Tensor, g: int) -> torch.Tensor:
    """[..., n, L] -> [..., 1, g * n, L]: the mask of `_sdpa_folded`'s query rows (row
    i * n + t is query head i of the group at row t)."""
    *lead, n, length = allowed.shape
    return allowed.unsqueeze(-3).expand(*lead, g, n, length).reshape(*lead, 1, g * n, length)


# Sequences with 2 to this many new rows in a step (a token and its speculative proposals,
# short prefill chunks) run attention as one padded batch instead of one call each.
SHORT_QUERY_ROWS = 8


def _decode_matmul(q, k, v, allowed, scale, softcap, sinks=None):
    """`_attend`'s "matmul" form for one query per sequence, as two plain batched matmuls.

    q [B, H, d]; k, v [B * KVH, L, d] (`_DecodePlan.gather`); allowed [B, 1, L];
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


class _DecodePlan:
    """What every layer's attention of one step shares for one group of short queries (built
    once per step by `plan_attention`): the sequences with `lo`..`hi` new tokens, their rows
    (padded to the group's longest by repeating a sequence's last row), block tables,
    positions, the visibility mask per sliding window and the gather rows per kv-head count
    (those the model uses, built with the plan). Group 1..1 is the decode rows;
    2..`SHORT_QUERY_ROWS` holds, e.g., a row and its speculative proposals."""

    whole = False  # see __init__

    def __init__(self, block_tables, query_start_loc, seq_lens, block_size: int, device,
                 lo: int = 1, hi: int = 1):  # fmt: skip
        self.device = torch.device(device)
        qsl = query_start_loc
        new = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
        self.decode = [i for i, n in enumerate(new) if lo <= n <= hi]
        if not self.decode:
            return
        self.n = max(new[i] for i in self.decode)
        rows = [[qsl[i] + min(j, new[i] - 1) for j in range(self.n)] for i in self.decode]
        pos = [[seq_lens[i] - new[i] + min(j, new[i] - 1) for j in range(self.n)]
               for i in self.decode]  # fmt: skip
        self.rows = torch.tensor(rows, device=device)  # [B, n]
        if self.n == 1:
            self.rows = self.rows[:, 0]  # [B]
        lens = [seq_lens[i] for i in self.decode]
        nb = -(-max(lens) // block_size)
        # Whole blocks are gathered: a contiguous [B, nb * block_size, ...] view of them needs
        # no copy, and the keys past each length are masked by causality.
        self.max_len = nb * block_size
        self.tables = block_tables[self.decode, :nb]
        self.q_pos = torch.tensor(pos, device=device)  # [B, n]
        self.k_pos = torch.arange(self.max_len, device=device)
        self._masks: dict[int | None, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}  # kv heads -> row indices for gather()
        # Every sequence decodes one token, in row order: q and out are used as they are
        # (no gather of q's rows, no scatter of the result), and float32 decode runs
        # `_decode_lean` from what `prepare` builds for it.
        self.whole = self.n == 1 and len(self.decode) == len(seq_lens)
        self.flat_tables = self.tables.reshape(-1) if self.whole else None
        # (window, kv heads) -> [B * KVH, 1, L] float32: 0 where visible, -inf elsewhere
        self._bias: dict[tuple[int | None, int], torch.Tensor] = {}
        # window -> [B, 1, 1, L] additive mask (0 / -inf, in the queries' dtype) in sdpa's
        # layout, for a group of one-token queries: sdpa turns a boolean mask into this
        # itself, on every call
        self._masks4: dict[int | None, torch.Tensor] = {}
        # (window, query heads per kv head) -> [B, 1, G * n, L]: `fold_mask` of the mask
        self._folded: dict[tuple[int | None, int], torch.Tensor] = {}

    def gather(
        self, cache: torch.Tensor, scale: torch.Tensor | None = None, dtype=None
    ) -> torch.Tensor:
        """The decode sequences' keys (or values) as [B * KVH, L, d], for `_decode_matmul`.

        One kv head: the whole blocks, already in that order. Several: one gather of d-long
        rows straight into that order (row indices built once per step), several times
        faster than gathering blocks and then moving the head dimension (docs/cpu-path.md).
        With a scale (int8 cache): dequantized to dtype.
        """
        nblocks, bs, kvh, d = cache.shape
        b, length = self.tables.shape[0], self.max_len
        if kvh == 1:
            return gather_kv(cache, self.tables, length, scale, dtype).view(b, length, d)
        rows_k = self._rows.get(kvh)
        if rows_k is None:  # not planned for (a direct call): built for this call only
            rows_k = self.gather_rows(kvh, bs)
        rows = torch.index_select(cache.view(nblocks * bs * kvh, d), 0, rows_k)
        if scale is not None:
            scales = torch.index_select(scale.view(-1), 0, rows_k)
            rows = dequantize(rows, scales, dtype)
        return rows.view(b * kvh, length, d)

    def gather_rows(self, kvh: int, block_size: int) -> torch.Tensor:
        b, length = self.tables.shape[0], self.max_len
        slots = self.tables.unsqueeze(-1) * block_size + torch.arange(
            block_size, device=self.device
        )
        heads = torch.arange(kvh, device=self.device).view(1, kvh, 1)
        return (slots.view(b, 1, length) * kvh + heads).reshape(-1)

    def prepare(self, windows: Sequence[int | None], kv_heads: Sequence[int], block_size: int,
                dtype: torch.dtype = torch.float32, num_heads: int | None = None):  # fmt: skip
        """Build the masks and gather rows the model's layers will ask for; `dtype`: the
        queries', which sdpa's additive masks must match; `num_heads`: the query heads, for
        the masks of several rows a sequence folded as `_sdpa_folded` takes them."""
        if not self.decode:
            return
        for w in windows:
            self._masks[w] = visible(self.q_pos, self.k_pos, w)
            if self.n != 1:
                for kvh in kv_heads:
                    if num_heads and num_heads // kvh > 1:
                        self._folded[(w, num_heads // kvh)] = fold_mask(
                            self._masks[w], num_heads // kvh
                        )
                continue
            bias = torch.zeros(self._masks[w].shape, device=self.device)  # [B, 1, L]
            bias.masked_fill_(~self._masks[w], float("-inf"))
            # 0 and -inf are exact in every float dtype; sdpa converts a boolean mask to
            # this on every call (up to a tenth of its time for one-token queries:
            # `python -m benchmarks.cpu_micro gqa`)
            self._masks4[w] = bias.to(dtype).unsqueeze(1)
            if self.whole:
                for kvh in kv_heads:
                    self._bias[(w, kvh)] = bias.repeat_interleave(kvh, dim=0)
        for kvh in kv_heads:
            if kvh > 1:
                self._rows[kvh] = self.gather_rows(kvh, block_size)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        m = self._masks.get(sliding_window)
        return visible(self.q_pos, self.k_pos, sliding_window) if m is None else m


def plan_attention(block_tables: torch.Tensor, query_start_loc: Sequence[int],
                   seq_lens: Sequence[int], block_size: int,
                   windows: Sequence[int | None] = (None,), kv_heads: Sequence[int] = (),
                   dtype: torch.dtype = torch.float32, num_heads: int | None = None,
                   ) -> tuple[_DecodePlan, _DecodePlan]:  # fmt: skip
    """`paged_attention`'s plan for one step: its decode and short-query groups, with the
    masks for `windows` (additive ones in the queries' `dtype`, folded ones for `num_heads`
    query heads over each of `kv_heads`) and the gather rows for `kv_heads` built."""
    args = (block_tables, query_start_loc, seq_lens, block_size, block_tables.device)
    plans = (_DecodePlan(*args), _DecodePlan(*args, lo=2, hi=SHORT_QUERY_ROWS))
    for plan in plans:
        plan.prepare(windows, kv_heads, block_size, dtype, num_heads)
    return plans


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
    plan: tuple[_DecodePlan, _DecodePlan] | None = None,
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
    plan, short = plan
    if plan.whole and k_scale is None and not softcap and sinks is None:
        lean = impl == "sdpa" or (
            q.dtype == torch.float32 and (sliding_window, k_cache.shape[2]) in plan._bias
        )
        if lean:
            return _decode_lean(out, q, k_cache, v_cache, plan, scale, sliding_window, impl)
    if out is None:
        out = q.new_empty(q.shape)
    decode = plan.decode + short.decode
    if plan.decode:
        # All one-token queries at once, padded to the longest context's whole blocks.
        allowed = plan.mask(sliding_window)  # [B, 1, L]
        if softcap or sinks is not None or impl == "matmul":
            k, v = plan.gather(k_cache, ks, dt), plan.gather(v_cache, vs, dt)  # [B * KVH, L, d]
            o = _decode_matmul(q[plan.rows], k, v, allowed, scale, softcap, sinks)
        else:
            k = gather_kv(k_cache, plan.tables, plan.max_len, ks, dt)  # [B, L, KVH, d]
            v = gather_kv(v_cache, plan.tables, plan.max_len, vs, dt)
            additive = plan._masks4.get(sliding_window)
            if additive is not None and additive.dtype == dt:
                allowed = additive.squeeze(1)  # [B, 1, L]: 0 / -inf
            o = _attend(q[plan.rows].unsqueeze(1), k, v, plan.q_pos, plan.k_pos, scale,
                        sliding_window, softcap, impl, allowed=allowed).squeeze(1)  # fmt: skip
        # Padding keys sit beyond each sequence's length, which causality already masks.
        out[plan.rows] = o.to(out.dtype)
    if short.decode:
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
            folded=short._folded.get((sliding_window, q.shape[1] // k_cache.shape[2])),
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


def _decode_lean(out, q, k_cache, v_cache, plan: _DecodePlan, scale: float,
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
        bias = plan._bias[(sliding_window, kvh)]
        if kvh == 1:
            k = torch.index_select(k_cache, 0, plan.flat_tables).view(b, length, d)
            v = torch.index_select(v_cache, 0, plan.flat_tables).view(b, length, d)
        else:
            rows = plan._rows[kvh]
            k = torch.index_select(k_cache.view(-1, d), 0, rows).view(b * kvh, length, d)
            v = torch.index_select(v_cache.view(-1, d), 0, rows).view(b * kvh, length, d)
        qg = q.reshape(b * kvh, h // kvh, d)
        scores = torch.baddbmm(bias, qg, k.mT, alpha=scale)  # [B * KVH, G, L]
        if out is None:
            return torch.bmm(scores.softmax(-1), v).view(b, h, d)
        torch.bmm(scores.softmax(-1), v, out=out.view(b * kvh, h // kvh, d))
        return out
    mask = plan._masks4.get(sliding_window)
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
# the padded batched matmuls, which cost more at these sizes (measured: docs/cpu-path.md).
DENSE_MAX_COLUMNS = 256


@dataclass(frozen=True)
class _Dense:
    """One width group run dense over rows [lo, hi): `slots` [S] the distinct slots,
    `mask` bool [hi - lo, S * width] (a row keeps its own slot's columns only)."""

    lo: int
    hi: int
    slots: torch.Tensor
    mask: torch.Tensor
    run: tuple[int, int] | None  # slots are run[0], .., run[1] - 1: a view of the stacks
    zero: torch.Tensor  # a 0-dim zero for the select (none made per call)
    # The group's one slot when every row of [lo, hi) uses it (a batch of one, or rows all on
    # one adapter): its own A and B multiply directly, with no select and no stacking.
    only: int | None = None

    @property
    def from_zero(self) -> bool:
        """The slots are 0, 1, .., S - 1."""
        return self.run is not None and self.run[0] == 0


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
    consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
    only = slots[0] if len(slots) == 1 and bool((owner >= 0).all()) else None
    return _Dense(lo, hi, torch.tensor(slots, device=device), mask.to(device),
                  run=(slots[0], slots[0] + len(slots)) if consecutive else None,
                  zero=torch.zeros((), device=device), only=only)  # fmt: skip


def plan_lora(
    segments: Sequence[tuple[int, int, int]], widths: Sequence[int], device: torch.device
) -> list[tuple[int, list[tuple[int, int, int]], _Batched | _Dense | None]]:
    """`lora_apply`'s plan: per width, a dense run (few adapters: `_Dense`), or the segments
    run one by one (index None) and those run batched (`_Batched`)."""
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
        segs = sorted(segs)  # row order: consecutive slots read as one view of the stacks
        plan.append((width, segs, _batched(segs, device)))
    return plan


@dataclass(frozen=True)
class _Batched:
    """Segments of similar length run as two batched matmuls over their slots' weights.

    `slots` (lo, hi): the segments' slots are lo, lo + 1, .., hi - 1 in row order, so their
    weights are a view of the stacks (no gather); None: gathered by `slot_index` [S].
    `rows` (r0, length): the segments are `length` rows each, one after another from row
    r0, so x and y are viewed as [S, length, features] (no gather, no scatter); None:
    padded by `index` (rows [S, L], the valid rows flattened, valid [S, L])."""

    slots: tuple[int, int] | None
    slot_index: torch.Tensor | None
    rows: tuple[int, int] | None
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def _batched(segs: list[tuple[int, int, int]], device: torch.device) -> _Batched:
    slot_list = [slot for _, _, slot in segs]
    lo = slot_list[0]
    slots = (lo, lo + len(segs)) if slot_list == list(range(lo, lo + len(segs))) else None
    lens = {e - s for s, e, _ in segs}
    r0, length = segs[0][0], segs[0][1] - segs[0][0]
    contiguous = len(lens) == 1 and all(s == r0 + i * length for i, (s, _, _) in enumerate(segs))
    if contiguous:
        index = None
    else:
        lens_l = [e - s for s, e, _ in segs]
        starts = torch.tensor([s for s, _, _ in segs], device=device)
        steps = torch.arange(max(lens_l), device=device)
        valid = steps < torch.tensor(lens_l, device=device).unsqueeze(1)  # [S, L]
        # Padding repeats the segment's first row; its results are dropped by `valid`.
        rows = torch.where(valid, starts.unsqueeze(1) + steps, starts.unsqueeze(1))  # [S, L]
        index = (rows, rows[valid], valid)
    return _Batched(
        slots=slots,
        slot_index=None if slots else torch.tensor(slot_list, device=device),
        rows=(r0, length) if contiguous else None,
        index=index,
    )


def _slot_weights(w: torch.Tensor, batched: _Batched, width: int) -> torch.Tensor:
    """The segments' slots' first `width` rows of a [slots, W, features] stack: a view where
    the slots are consecutive, else a gathered copy."""
    if batched.slots is not None:
        lo, hi = batched.slots
        w = w if (lo, hi) == (0, w.shape[0]) else w[lo:hi]
        return w if width == w.shape[1] else w[:, :width]
    return w[:, :width].index_select(0, batched.slot_index)


def _stacked(w: torch.Tensor, dense: _Dense, width: int) -> torch.Tensor:
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
    plan: list | None = None,
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
    for width, segs, index in plan:
        if index is None:
            sgmv_expand(y, sgmv_shrink(x, lora_a, segs, widths), lora_b, segs, widths)
            continue
        if isinstance(index, _Dense):
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


def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm needs a unit stride in each matrix and its other strides a multiple
    of 16 bytes."""
    align = 16 // t.element_size()
    strides = list(t.stride())
    unit = -1 if strides[-1] == 1 else -2
    if strides[unit] != 1:
        return False
    del strides[unit]
    return all(s % align == 0 for s in strides)


# What one per-group call of torch._grouped_mm costs, as bytes of gathered weights: the
# per-row form is taken while the matrices it copies beyond one per group stay under this
# per group (benchmarks/moe.py measures the expert LoRA that depends on it).
_CALL_BYTES = 64 * 1024


def _take(w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """w.index_select(0, index), copied in w's own memory order: a transposed view (nn.Linear
    rows, [G, N, K] seen as [G, K, N]) gathered as the rows it is, then viewed back, rather
    than transposed element by element into a new layout."""
    if w.stride(1) == 1 and w.stride(2) != 1:
        return w.transpose(1, 2).index_select(0, index).transpose(1, 2)
    return w.index_select(0, index)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`reference.grouped_mm` with torch's grouped matmul.

    torch._grouped_mm's CPU form runs one matmul per group, each at a fixed cost, empty or
    not: when most groups are empty (LoRA over adapter slots x experts) it runs over the
    non-empty groups only, whose weights it gathers (small then: rank x features each). When
    those hold a row or two each (a decode step: one row per virtual expert), every row
    takes its group's matrix instead and all rows go through one batched matmul: a gather of
    rows x K x N, no per-group call. That form copies a matrix for every row past a group's
    first; it is taken while those copies are small next to the calls they save (LoRA's
    rank x features matrices, never the experts' own at a decode step). Shapes
    torch._grouped_mm cannot take (a rank below 16 bytes) are zero-padded. Rows from
    offs[G-1] on are unspecified.
    """
    p, (g, k, n) = x.shape[0], w.shape
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    used = counts.nonzero().squeeze(1)  # [groups with rows]
    if used.numel() == 0:
        return x.new_zeros(p, n)
    rows, groups = int(offs[-1]), used.numel()
    if rows <= 2 * groups and (rows - groups) * k * n * w.element_size() <= groups * _CALL_BYTES:
        group = torch.repeat_interleave(torch.arange(g, device=x.device), counts,
                                        output_size=rows)  # fmt: skip
        if x.dtype == w.dtype == torch.float32 and w.is_contiguous():
            # Each row a sum of its group's K weight rows scaled by its own K values: one
            # embedding_bag reads them in place, without gathering a copy first.
            index = (group.unsqueeze(1) * k + torch.arange(k, device=x.device)).flatten()
            bags = torch.arange(0, rows * k, k, device=x.device)
            y = F.embedding_bag(index, w.view(g * k, n), bags, mode="sum",
                                per_sample_weights=x[:rows].flatten())  # fmt: skip
        else:
            y = torch.matmul(x[:rows].unsqueeze(1), _take(w, group)).squeeze(1)
        return y if rows == p else torch.cat([y, y.new_zeros(p - rows, n)])
    if 4 * groups <= g:
        w, offs = _take(w, used), offs.index_select(0, used)
    if _aligned(x) and _aligned(w):
        return torch._grouped_mm(x, w, offs=offs)
    align = 16 // x.element_size()
    kp, np_ = -(-k // align) * align, -(-n // align) * align
    xp = x.new_zeros(p, kp)
    xp[:, :k] = x
    wp = w.new_zeros(w.shape[0], kp, np_)
    wp[:, :k, :n] = w
    return torch._grouped_mm(xp, wp, offs=offs)[:, :n]


# The shrink of `grouped_lora_rows` reads A^T in place through embedding_bag while a row of the
# table (the width read per input feature) is at least this many bytes; under it the
# per-index cost of embedding_bag outweighs copying each row's whole A^T block.
_SHRINK_ROW_BYTES = 32


def grouped_lora_rows(x: torch.Tensor, a_t: torch.Tensor, b: torch.Tensor, group: torch.Tensor,
                      width: int) -> torch.Tensor:  # fmt: skip
    """delta[p] = (x[p] @ a_t[group[p], :, :width]) @ b[group[p], :width]: each row through its
    own group's LoRA (expert LoRA at a decode step: about one row per adapter slot x expert),
    the per-row form of two `grouped_mm` calls that needs no sort by group.

    Shape: x [P, K]; a_t [G, K, Wa] (each group's A transposed) and b [G, Wb, N], both
    contiguous (width <= Wa, Wb: a group's A columns and B rows past its own width are zeros);
    group [P] int64. Returns [P, N] in x's dtype.

    The stacks are read in place through embedding_bag, which sums table rows scaled by
    per-row weights (float32, bf16 and fp16 alike: it accumulates in float32 and rounds once,
    as the matmul it replaces does, and in bf16 it is about 3.5 times faster than copying
    each row's blocks, at a decode step of the tiny Qwen3-MoE in benchmarks/moe.py): the
    expand sums row p's `width` rows of B scaled by its shrunk values; the shrink its K rows
    of A^T scaled by x[p], each row split at `width` where that divides Wa, so the zero
    columns past it are not read. A narrow shrink (rank 2: a few bytes per index) copies each
    row's A^T block instead and multiplies."""
    p, (g, k, wa), (wb, n) = x.shape[0], a_t.shape, b.shape[1:]
    dev = x.device
    # int32 indices (half the bytes to write and read) while the tables' rows fit
    index = torch.int32 if g * max(k * wa, wb) < 2**31 else torch.int64
    group = group.to(index)
    c = width if wa % width == 0 else wa
    in_place = (torch.float32, torch.bfloat16, torch.float16)
    if x.dtype == a_t.dtype in in_place and c * a_t.element_size() >= _SHRINK_ROW_BYTES:
        split = wa // c  # table rows per A^T row
        rows = group.unsqueeze(1) * (k * split) + torch.arange(0, k * split, split, device=dev,
                                                               dtype=index)  # fmt: skip
        bags = torch.arange(0, p * k, k, device=dev, dtype=index)
        xa = F.embedding_bag(rows.flatten(), a_t.view(-1, c), bags, mode="sum",
                             per_sample_weights=x.flatten())[:, :width]  # fmt: skip
    else:
        xa = torch.matmul(x.unsqueeze(1), a_t.index_select(0, group)[:, :, :width]).squeeze(1)
    if xa.dtype == b.dtype in in_place:
        rows = group.unsqueeze(1) * wb + torch.arange(width, device=dev, dtype=index)
        bags = torch.arange(0, p * width, width, device=dev, dtype=index)
        return F.embedding_bag(rows.flatten(), b.view(-1, n), bags, mode="sum",
                               per_sample_weights=xa.flatten())  # fmt: skip
    gb = b.index_select(0, group)[:, :width]  # other dtypes: each row's B rows copied
    return torch.matmul(xa.unsqueeze(1), gb).squeeze(1)


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
