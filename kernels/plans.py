"""The kernel backends' per-step plans, as types: what `KernelBackend.plan_attention` and
`plan_lora` return, built once per step before the forward (engine/step/step_plan.py) and read
by every layer. The CPU's are in cpu_plan.py; the Triton kernels' are here, apart from the
modules that define the kernels (importing those builds them: kernels/backend.py says why).
The torch reference plans nothing (None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.cpu_plan import CPUAttentionPlan, CPULoRAPlan


@dataclass(frozen=True)
class TritonAttentionPlan:
    """paged_attention.py's index tensors for one step, on the device (`plan_attention`):
    its launches then copy nothing. A tile is `block_q` query rows of one sequence, times the
    `gp` query heads of one kv head."""

    q_end: torch.Tensor  # [num_seqs] int32: each sequence's end row (query_start_loc[1:])
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    decode_tiles: torch.Tensor | None  # [2, tiles] int32: (sequence, first row); None: no decode
    prefill_tiles: torch.Tensor | None  # [2, tiles] int32, sequences with several new rows
    decode_rows: torch.Tensor | None  # [decode sequences] int32: their rows (split-KV's merge)
    gp: int  # query heads per kv head, rounded up to a power of two
    decode_block_q: int  # rows of a decode tile (decode_block_m // gp)
    prefill_block_q: int


@dataclass(frozen=True)
class SGMVMeta:
    """sgmv.py's row tiles for one step's segments and one set of slot widths, on the device
    (`sgmv.build_meta`); padded with empty tiles they can be refilled in place."""

    tile_start: torch.Tensor  # [num_tiles] int32: first row of the tile
    tile_end: torch.Tensor  # [num_tiles] int32: end of the tile's segment (exclusive)
    tile_slot: torch.Tensor  # [num_tiles] int32: adapter slot, -1 = no adapter
    widths: torch.Tensor  # [num_slots] int32: rank rows each slot uses
    block_m: int  # rows per tile


# What a step's AttentionMetadata and LoRABatch carry for their backend (None: the reference,
# or no LoRA work for that width set)
AttentionPlan = CPUAttentionPlan | TritonAttentionPlan | None
LoRAPlan = CPULoRAPlan | SGMVMeta | None
