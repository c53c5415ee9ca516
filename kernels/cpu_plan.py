"""The CPU backend's per-step plans, built once per step before the forward (the step planner,
engine/step/step_plan.py, through KernelBackend.plan_attention / plan_lora) and read by every
layer's `cpu.paged_attention` / `cpu.lora_apply`: typed dataclasses, every tensor's shape
beside it. Nothing here runs a kernel; a plan is never changed after it is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraplex.kernels.reference import dequantize, gather_kv, visible

Segment = tuple[int, int, int]  # (start_row, end_row, slot), slot -1: no adapter

# Sequences with 2 to this many new rows in a step (a token and its speculative proposals,
# short prefill chunks) run attention as one padded batch instead of one call each.
SHORT_QUERY_ROWS = 8


def fold_mask(allowed: torch.Tensor, g: int) -> torch.Tensor:
    """[..., n, L] -> [..., 1, g * n, L]: the mask of `_sdpa_folded`'s query rows (row
    i * n + t is query head i of the group at row t)."""
    *lead, n, length = allowed.shape
    return allowed.unsqueeze(-3).expand(*lead, g, n, length).reshape(*lead, 1, g * n, length)


# ------------------------------------------------------------------------------ attention
@dataclass
class DecodeGroup:
    """One group of short queries of a step: the B sequences with `lo`..`hi` new tokens
    (`decode_group`), their rows padded to the group's longest by repeating a sequence's last
    row, and what every layer's attention over them shares: the visibility masks per sliding
    window and the gather rows per kv-head count the model uses (`prepare`). Group 1..1 is
    the decode rows; 2..SHORT_QUERY_ROWS holds, e.g., a row and its speculative proposals."""

    seqs: list[int]  # B: the group's sequences (indices into the step's)
    n: int = 0  # query rows per sequence (padded)
    rows: torch.Tensor | None = None  # [B] (n == 1) or [B, n] int64: each query's row
    tables: torch.Tensor | None = None  # [B, nb] int64: whole blocks up to the longest context
    max_len: int = 0  # L = nb * block_size: keys gathered per sequence
    q_pos: torch.Tensor | None = None  # [B, n] int64: each query's position
    k_pos: torch.Tensor | None = None  # [L] int64
    # Every sequence of the step decodes one token, in row order: q and out are used as they
    # are (no gather of q's rows, no scatter of the result), and `flat_tables` [B * nb] serves
    # the leanest decode (`cpu._decode_lean`).
    whole: bool = False
    flat_tables: torch.Tensor | None = None
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [B, n, L]
    # window -> [B, 1, 1, L]: the mask as 0 / -inf in the queries' dtype, sdpa's layout (sdpa
    # turns a boolean mask into this itself, on every call)
    masks4: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # (window, kv heads) -> [B * KVH, 1, L] float32: 0 where visible, -inf elsewhere
    bias: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)
    # (window, query heads per kv head G) -> [B, 1, G * n, L]: `fold_mask` of the mask
    folded: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)
    kv_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # KVH -> [B * KVH * L]

    def gather(
        self, cache: torch.Tensor, scale: torch.Tensor | None = None, dtype=None
    ) -> torch.Tensor:
        """The group's keys (or values) as [B * KVH, L, d], for `cpu._decode_matmul`.

        One kv head: the whole blocks, already in that order. Several: one gather of d-long
        rows straight into that order (row indices planned once per step), several times
        faster than gathering blocks and then moving the head dimension (docs/cpu-path.md).
        With a scale (int8 cache): dequantized to dtype.
        """
        nblocks, bs, kvh, d = cache.shape
        b, length = self.tables.shape[0], self.max_len
        if kvh == 1:
            return gather_kv(cache, self.tables, length, scale, dtype).view(b, length, d)
        rows_k = self.kv_rows.get(kvh)
        if rows_k is None:  # not planned for (a direct call): built for this call only
            rows_k = self.gather_rows(kvh, bs)
        rows = torch.index_select(cache.view(nblocks * bs * kvh, d), 0, rows_k)
        if scale is not None:
            scales = torch.index_select(scale.view(-1), 0, rows_k)
            rows = dequantize(rows, scales, dtype)
        return rows.view(b * kvh, length, d)

    def gather_rows(self, kvh: int, block_size: int) -> torch.Tensor:
        """[B * KVH * L] int64: the flat cache rows of each (sequence, kv head, key)."""
        b, length, dev = self.tables.shape[0], self.max_len, self.tables.device
        slots = self.tables.unsqueeze(-1) * block_size + torch.arange(block_size, device=dev)
        heads = torch.arange(kvh, device=dev).view(1, kvh, 1)
        return (slots.view(b, 1, length) * kvh + heads).reshape(-1)

    def prepare(self, windows: Sequence[int | None], kv_heads: Sequence[int], block_size: int,
                dtype: torch.dtype = torch.float32, num_heads: int | None = None):  # fmt: skip
        """Build the masks and gather rows the model's layers will ask for; `dtype`: the
        queries', which sdpa's additive masks must match; `num_heads`: the query heads, for
        the masks of several rows a sequence folded as `cpu._sdpa_folded` takes them."""
        if not self.seqs:
            return
        for w in windows:
            self.masks[w] = visible(self.q_pos, self.k_pos, w)
            if self.n != 1:
                for kvh in kv_heads:
                    g = num_heads // kvh if num_heads else 1
                    if g > 1:
                        self.folded[(w, g)] = fold_mask(self.masks[w], g)
                continue
            bias = torch.zeros(self.masks[w].shape, device=self.tables.device)  # [B, 1, L]
            bias.masked_fill_(~self.masks[w], float("-inf"))
            # 0 and -inf are exact in every float dtype (sdpa's own conversion of a boolean
            # mask takes up to a tenth of its time for one-token queries:
            # `python -m benchmarks.cpu_micro gqa`)
            self.masks4[w] = bias.to(dtype).unsqueeze(1)
            if self.whole:
                for kvh in kv_heads:
                    self.bias[(w, kvh)] = bias.repeat_interleave(kvh, dim=0)
        for kvh in kv_heads:
            if kvh > 1:
                self.kv_rows[kvh] = self.gather_rows(kvh, block_size)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        m = self.masks.get(sliding_window)
        return visible(self.q_pos, self.k_pos, sliding_window) if m is None else m


def decode_group(block_tables: torch.Tensor, query_start_loc: Sequence[int],
                 seq_lens: Sequence[int], block_size: int, lo: int = 1,
                 hi: int = 1) -> DecodeGroup:  # fmt: skip
    """The sequences with `lo`..`hi` new rows, as one `DecodeGroup` (masks not yet built)."""
    qsl, device = query_start_loc, block_tables.device
    new = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
    seqs = [i for i, n in enumerate(new) if lo <= n <= hi]
    if not seqs:
        return DecodeGroup(seqs)
    n = max(new[i] for i in seqs)
    rows = [[qsl[i] + min(j, new[i] - 1) for j in range(n)] for i in seqs]
    pos = [[seq_lens[i] - new[i] + min(j, new[i] - 1) for j in range(n)] for i in seqs]
    nb = -(-max(seq_lens[i] for i in seqs) // block_size)
    # Whole blocks are gathered: a contiguous [B, nb * block_size, ...] view of them needs no
    # copy, and the keys past each length are masked by causality.
    tables = block_tables[seqs, :nb]
    whole = n == 1 and len(seqs) == len(seq_lens)
    rows_t = torch.tensor(rows, device=device)  # [B, n]
    return DecodeGroup(
        seqs=seqs, n=n, rows=rows_t[:, 0] if n == 1 else rows_t, tables=tables,
        max_len=nb * block_size, q_pos=torch.tensor(pos, device=device),
        k_pos=torch.arange(nb * block_size, device=device), whole=whole,
        flat_tables=tables.reshape(-1) if whole else None,
    )  # fmt: skip


@dataclass(frozen=True)
class CPUAttentionPlan:
    """`cpu.paged_attention`'s plan for one step; the other sequences (longer prefill chunks)
    run one by one and need none."""

    decode: DecodeGroup  # sequences with one new token
    short: DecodeGroup  # sequences with 2..SHORT_QUERY_ROWS new tokens


def plan_attention(block_tables: torch.Tensor, query_start_loc: Sequence[int],
                   seq_lens: Sequence[int], block_size: int,
                   windows: Sequence[int | None] = (None,), kv_heads: Sequence[int] = (),
                   dtype: torch.dtype = torch.float32, num_heads: int | None = None,
                   ) -> CPUAttentionPlan:  # fmt: skip
    """`paged_attention`'s plan for one step: its decode and short-query groups, with the
    masks for `windows` (additive ones in the queries' `dtype`, folded ones for `num_heads`
    query heads over each of `kv_heads`) and the gather rows for `kv_heads` built."""
    args = (block_tables, query_start_loc, seq_lens, block_size)
    plan = CPUAttentionPlan(decode_group(*args), decode_group(*args, lo=2, hi=SHORT_QUERY_ROWS))
    for group in (plan.decode, plan.short):
        group.prepare(windows, kv_heads, block_size, dtype, num_heads)
    return plan


# ----------------------------------------------------------------------------------- LoRA
# A width group of at most this many adapter columns (slots x width) runs "dense": one
# matmul against every slot's A stacked, the other slots' columns zeroed per row, one matmul
# against the stacked B. It computes (slots) times the LoRA flops but skips the gathers and
# the padded batched matmuls, which cost more at these sizes (measured: docs/cpu-path.md).
DENSE_MAX_COLUMNS = 256


@dataclass(frozen=True)
class Dense:
    """One width group run dense over rows [lo, hi)."""

    lo: int
    hi: int
    slots: torch.Tensor  # [S] int64: the distinct slots
    mask: torch.Tensor  # [hi - lo, S * width] bool: a row keeps its own slot's columns only
    run: tuple[int, int] | None  # slots are run[0], .., run[1] - 1: a view of the stacks
    zero: torch.Tensor  # [] a zero for the select (none made per call)
    # The group's one slot when every row of [lo, hi) uses it (a batch of one, or rows all on
    # one adapter): its own A and B multiply directly, with no select and no stacking.
    only: int | None = None


@dataclass(frozen=True)
class Batched:
    """Segments of similar length run as two batched matmuls over their slots' weights."""

    # (lo, hi): the segments' slots are lo, lo + 1, .., hi - 1 in row order, so their weights
    # are a view of the stacks (no gather); None: gathered by `slot_index`
    slots: tuple[int, int] | None
    slot_index: torch.Tensor | None  # [S] int64
    # (r0, length): the segments are `length` rows each, one after another from row r0, so
    # x and y are viewed as [S, length, features] (no gather, no scatter); None: by `index`
    rows: tuple[int, int] | None
    # padded rows [S, L] int64, the valid ones flattened [valid rows], valid [S, L] bool
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class LoRAGroup:
    width: int  # every segment's slot has this width
    segments: list[Segment]
    form: Dense | Batched | None  # None: segment by segment (long prefill chunks)


@dataclass(frozen=True)
class CPULoRAPlan:
    """`cpu.lora_apply`'s plan for one step's segments and one set of slot widths."""

    groups: list[LoRAGroup]


def _batchable(segs: list[Segment]) -> tuple[list, list]:
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


def _dense(segs: list[Segment], width: int, device: torch.device) -> Dense | None:
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
    return Dense(lo, hi, torch.tensor(slots, device=device), mask.to(device),
                 run=(slots[0], slots[0] + len(slots)) if consecutive else None,
                 zero=torch.zeros((), device=device), only=only)  # fmt: skip


def _batched(segs: list[Segment], device: torch.device) -> Batched:
    slot_list = [slot for _, _, slot in segs]
    lo = slot_list[0]
    slots = (lo, lo + len(segs)) if slot_list == list(range(lo, lo + len(segs))) else None
    lens = {e - s for s, e, _ in segs}
    r0, length = segs[0][0], segs[0][1] - segs[0][0]
    contiguous = len(lens) == 1 and all(s == r0 + i * length for i, (s, _, _) in enumerate(segs))
    index = None
    if not contiguous:
        lens_l = [e - s for s, e, _ in segs]
        starts = torch.tensor([s for s, _, _ in segs], device=device)
        steps = torch.arange(max(lens_l), device=device)
        valid = steps < torch.tensor(lens_l, device=device).unsqueeze(1)  # [S, L]
        # Padding repeats the segment's first row; its results are dropped by `valid`.
        rows = torch.where(valid, starts.unsqueeze(1) + steps, starts.unsqueeze(1))  # [S, L]
        index = (rows, rows[valid], valid)
    return Batched(
        slots=slots,
        slot_index=None if slots else torch.tensor(slot_list, device=device),
        rows=(r0, length) if contiguous else None,
        index=index,
    )


def plan_lora(segments: Sequence[Segment], widths: Sequence[int],
              device: torch.device) -> CPULoRAPlan:  # fmt: skip
    """`lora_apply`'s plan: per width, a dense run (few adapters: `Dense`), or the segments
    run one by one (form None) and those run batched (`Batched`)."""
    by_width: dict[int, list[Segment]] = {}
    for s, e, slot in segments:
        if slot >= 0 and widths[slot]:
            by_width.setdefault(widths[slot], []).append((s, e, slot))
    groups = []
    for width, all_segs in by_width.items():
        dense = _dense(all_segs, width, device)
        if dense is not None:
            groups.append(LoRAGroup(width, all_segs, dense))
            continue
        segs, alone = _batchable(all_segs)
        if alone:
            groups.append(LoRAGroup(width, alone, None))
        if segs:
            segs = sorted(segs)  # row order: consecutive slots read as one view of the stacks
            groups.append(LoRAGroup(width, segs, _batched(segs, device)))
    return CPULoRAPlan(groups)
