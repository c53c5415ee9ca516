"""A step's metadata as the model reads it: `ForwardContext` and its parts, typed.

The step planner (engine/step/step_plan.py) builds all of it before the forward, once per step
(for a graph-ready decode step, once per captured batch bucket, over persistent buffers);
the layers (engine/models/) only read it and build nothing per step themselves. It lives
below both, so that the model and the planner each import it and neither imports the other's
folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.kernels.plans import AttentionPlan, LoRAPlan

Segment = tuple[int, int, int]  # (start_row, end_row, slot), slot -1: no adapter


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: KV slot of each new token
    query_start_loc: list[int]  # num_seqs + 1: row range of each sequence's new tokens
    seq_lens: list[int]  # num_seqs: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    # the kernel backend's plan for these tables and lengths (KernelBackend.plan_attention:
    # the CPU's decode groups with masks and gather rows, Triton's tile lists on the device)
    plan: AttentionPlan = None


@dataclass
class DoRARows:
    """The rows of a step whose adapter uses DoRA, for LoRALinear's epilogue (each module's
    `lora_dora` factor per slot, engine/adapters/manager.py)."""

    slots: torch.Tensor  # [n] int64: each such row's slot (-1: none, whose factors are ones)
    rows: torch.Tensor | None  # [n] int64: which rows; None: every row of the step
    # the DoRA slots among them: a module none of them adapts with DoRA skips the epilogue
    on: frozenset[int] = frozenset()


@dataclass
class LoRABatch:
    """Rows grouped by adapter slot: (start_row, end_row, slot), slot -1 = no adapter."""

    segments: list[Segment]
    # [num_tokens] int64: each row's slot (-1: none), for the experts' per-row LoRA and DoRA
    row_slots: torch.Tensor | None = None
    # a module's slot widths (one per slot) -> the backend's plan for these segments and
    # widths (KernelBackend.plan_lora); every distinct width set of the model's modules
    plans: dict[tuple[int, ...], LoRAPlan] = field(default_factory=dict)
    # an expert stack's slot widths -> [num_slots] bool: which slots hold an expert adapter
    expert_slots: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    # a graph-ready decode step (engine/step/graph_runner.py): no segments, only row_slots
    static: bool = False
    # rows whose adapter uses DoRA (None: none in this step, and no module does DoRA work);
    # in a static step every module applies it (which modules are DoRA changes with slot
    # writes, a captured graph does not)
    dora: DoRARows | None = None


@dataclass
class StaticDecode:
    """A decode step read only from fixed-shape buffers (one query per row), so that a CUDA
    graph can replay it: each row's context length and block table as tensors."""

    seq_lens: torch.Tensor  # [rows] int64: context length after this step (>= 1)
    block_tables: torch.Tensor  # [rows, max_blocks] int64, padded with 0


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    lora: LoRABatch | None  # None when no row has an adapter
    # Rotary.key -> (cos, sin) [num_tokens, 1, rotary_dim] in the activations' dtype at this
    # step's positions: each distinct table's rows, looked up once for every layer using it
    rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    static: StaticDecode | None = None  # set: a graph-ready decode step
    # Rotary.key -> [num_tokens, 3 * rotary_dim / 2] rows cos | -sin | sin in the activations'
    # dtype (fused_reference.rope_rows), for the fused RoPE + KV write; empty: Rotary's path
    rope_rows: dict[tuple, torch.Tensor] = field(default_factory=dict)
