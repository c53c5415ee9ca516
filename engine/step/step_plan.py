"""The step plan: all of a step's metadata, built by the model runner before the forward.

A forward pass reads a `ForwardContext` (engine/forward_context.py: its fields are typed and
say their shapes). Everything in it that the layers share is built here, once per step, and
nothing in a layer builds or keeps anything per step:

- attention: KV slots of the new tokens, block tables, lengths, and the kernel backend's plan
  for them (the CPU's decode groups with their masks per sliding window and gather rows per
  kv-head count; Triton's tile lists, on the device);
- RoPE: each distinct table's cos and sin at the step's positions;
- LoRA: the rows' segments per adapter slot, each row's slot, the backend's plan for every
  distinct set of slot widths among the model's LoRA modules, which slots hold expert
  adapters per expert stack, and the rows whose adapter uses DoRA (none: no DoRA work).

A graph-ready decode step (engine/step/graph_runner.py) reads a context built here too, once
per batch bucket, over the runner's persistent buffers (`static_context`); only its RoPE rows
are looked up inside the forward (`rope`), from the positions buffer, so a replay reads them.
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.forward_context import (
    AttentionMetadata,
    DoRARows,
    ForwardContext,
    LoRABatch,
    Segment,
    StaticDecode,
)
from loraplex.engine.models.layers import Attention, LoRALinear, Rotary
from loraplex.engine.models.moe import Experts
from loraplex.kernels.backend import KernelBackend
from loraplex.kernels.fused_reference import rope_rows as rope_rows_of


class StepPlanner:
    """Builds a model's ForwardContext for each step. Knows, from the model, which RoPE
    tables, sliding windows, kv-head counts and LoRA modules a forward will touch."""

    def __init__(self, model: nn.Module, backend: KernelBackend, block_size: int):
        spec = model.spec
        self.backend, self.block_size, self.spec = backend, block_size, spec
        self.dtype = model.dtype
        self.rotaries = list({m.key: m for m in model.modules() if isinstance(m, Rotary)}.values())
        self.windows = list(dict.fromkeys(spec.windows))
        # the modules whose slots the adapter manager fills (it runs before the planner)
        self.lora_modules = [m for m in model.modules()
                             if isinstance(m, LoRALinear) and m.lora_a is not None]  # fmt: skip
        self.experts = [m for m in model.modules() if isinstance(m, Experts)]
        # RoPE's (cos, sin) pairs serve only attention layers that cannot take the fused RoPE
        # + KV write (an int8 cache, a rotated cache: engine/memory/kv_cache.py, allocated before
        # this); the others read `rope_rows`
        self.rope_pairs = any(
            m.k_scale is not None or m.kv_rotation is not None
            for m in model.modules()
            if isinstance(m, Attention)
        )
        self.model = model  # its `lora_dora_slots`: the adapter manager's, set after this

    def plan(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        query_start_loc: list[int],  # num_seqs + 1
        seq_lens: list[int],  # num_seqs
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
        segments: list[Segment],
    ) -> ForwardContext:
        spec, backend = self.spec, self.backend
        plan = backend.plan_attention(
            block_tables, query_start_loc, seq_lens, self.block_size, spec.num_heads,
            spec.num_kv_heads, self.windows, self.dtype,
        )  # fmt: skip
        attn = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_tables=block_tables, plan=plan,
        )  # fmt: skip
        rope = self.rope(positions) if self.rope_pairs else {}
        rope_rows = {r.key: rope_rows_of(r.cos_sin, positions, self.dtype) for r in self.rotaries}
        lora = None
        if any(slot >= 0 for *_, slot in segments):
            dev = positions.device
            dora_slots = getattr(self.model, "lora_dora_slots", ())  # per slot: uses DoRA
            # each row's slot: for expert LoRA and DoRA's rows only
            rows = None
            if self.experts or any(dora_slots):
                rows = row_slots(segments, positions.shape[0], dev)
            lora = LoRABatch(segments, row_slots=rows)
            for widths in {tuple(m.lora_widths) for m in self.lora_modules}:
                lora.plans[widths] = backend.plan_lora(segments, widths, dev)
            for ex in self.experts:
                key = tuple(ex.lora_widths)
                if key not in lora.expert_slots:
                    lora.expert_slots[key] = torch.tensor([w > 0 for w in key], device=dev)
            if any(dora_slots):
                lora.dora = _dora_rows(segments, lora.row_slots, dora_slots)
        return ForwardContext(attn=attn, lora=lora, rope=rope, rope_rows=rope_rows)

    def static_context(
        self,
        slot_mapping: torch.Tensor,  # [rows] int64 buffer (-1 or a scratch slot: padding)
        block_tables: torch.Tensor,  # [rows, max_blocks] int64 buffer
        seq_lens: torch.Tensor,  # [rows] int64 buffer (>= 1)
        row_slots: torch.Tensor,  # [rows] int64 buffer: each row's adapter slot (-1: none)
        lora: bool,  # some row has an adapter
        dora: bool,  # some row's adapter uses DoRA
    ) -> ForwardContext:
        """A graph-ready decode step's context over persistent buffers (one batch bucket's
        views), built once for every replay: the buffers' contents change, never the context.
        Its `rope` is empty: the forward fills it from the positions buffer (`rope`)."""
        static = StaticDecode(seq_lens=seq_lens, block_tables=block_tables)
        attn = AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=[], seq_lens=[],
                                 block_tables=block_tables)  # fmt: skip
        batch = None
        if lora:
            batch = LoRABatch([], row_slots=row_slots, static=True)
            if dora:
                batch.dora = DoRARows(slots=row_slots, rows=None)
        return ForwardContext(attn=attn, lora=batch, static=static)

    def rope(self, positions: torch.Tensor) -> dict[tuple, tuple[torch.Tensor, torch.Tensor]]:
        """Each RoPE table's (cos, sin) at `positions`: a graph-ready step looks them up inside
        its forward, so that a captured graph reads the positions buffer at each replay."""
        return {r.key: r.tables(positions, self.dtype) for r in self.rotaries}


def row_slots(segments: list[Segment], rows: int, device) -> torch.Tensor:
    """The adapter slot of every row [rows] int64 (-1: none)."""
    slots = [-1] * rows
    for start, end, slot in segments:
        slots[start:end] = [slot] * (end - start)
    return torch.tensor(slots, dtype=torch.int64, device=device)


def _dora_rows(segments, row_slots: torch.Tensor, dora_slots) -> DoRARows | None:
    """The rows of DoRA adapters' segments (None: there are none in this step)."""
    on = [(s, e, slot) for s, e, slot in segments if slot >= 0 and dora_slots[slot]]
    if not on:
        return None
    slots = frozenset(slot for *_, slot in on)
    if sum(e - s for s, e, _ in on) == row_slots.shape[0]:
        return DoRARows(slots=row_slots, rows=None, on=slots)
    rows = torch.cat([torch.arange(s, e) for s, e, _ in on])
    picked = torch.cat([torch.full((e - s,), slot) for s, e, slot in on])
    dev = row_slots.device
    return DoRARows(slots=picked.to(dev), rows=rows.to(dev), on=slots)
