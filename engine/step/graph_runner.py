"""Graph-ready decode: a decode step's forward run only from persistent buffers.

A step in which every sequence decodes one token (`DecodeInputs`) is copied into buffers
sized for the largest batch bucket (1, 2, 4, 8, ... up to max_num_seqs), padded to its bucket,
and the forward reads nothing else, through a context the step planner built over them once
(StepPlanner.static_context): token ids, positions, KV slots, block tables and context
lengths as tensors; LoRA as each row's slot (`lora_apply_static`: every slot's columns in
one matmul, the others zeroed per row), so writing another adapter into a slot changes only
the slot tensors a captured graph already reads; padded rows have no adapter, no KV slot (-1:
not written) and a context of one. A batch with no adapter at all takes a forward without
LoRA; one where some row's adapter uses DoRA takes a third forward, in which every LoRA
module applies the slots' DoRA factors to its rows (ones for rows and modules without DoRA:
exact).

On CUDA each (bucket, LoRA or not, DoRA or not) forward is captured once as a CUDA graph and
replayed; the engine captures every bucket with and without LoRA at start (`capture_all`),
DoRA's on first use. On the CPU the same forward runs eagerly from the same buffers
(`enforce_eager=False`): the emulation that tests/engine/test_graph_decode.py compares with the
ordinary step, so the bugs graphs cause (stale metadata, shapes that follow the batch, lists
read inside the forward) show without a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.engine.models.moe import SparseMoE
from loraplex.engine.step.step_plan import StepPlanner

log = logging.getLogger("loraplex.engine")


def buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


@dataclass
class DecodeInputs:
    """One graph-ready decode step as the model runner prepares it: n rows, row i one
    sequence's one new token (host lists: `DecodeGraphs.run` copies them into its buffers)."""

    input_ids: list[int]  # n
    positions: list[int]  # n
    slot_mapping: list[int]  # n: each token's KV slot
    block_tables: list[list[int]]  # n tables, unpadded
    seq_lens: list[int]  # n: context length after this step
    row_slots: list[int]  # n: each row's adapter slot (-1: none)


class DecodeGraphs:
    def __init__(self, model, planner: StepPlanner, max_batch: int, max_blocks: int,
                 scratch_slot: int, capture: bool):  # fmt: skip
        self.model, self.capture, self.scratch = model, capture, scratch_slot
        self.planner = planner  # builds each bucket's context over the buffers
        self.buckets = buckets(max_batch)
        dev, z = model.device, dict(dtype=torch.int64, device=model.device)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, **z)
        self.positions = torch.zeros(n, **z)
        self.slot_mapping = torch.full((n,), scratch_slot, **z)
        self.block_tables = torch.zeros(n, max_blocks, **z)
        self.seq_lens = torch.ones(n, **z)
        self.row_slots = torch.full((n,), -1, **z)
        self.hidden = torch.zeros(n, model.spec.hidden_size, dtype=model.dtype, device=dev)
        self.graphs: dict[tuple[int, bool, bool], Callable[[], None]] = {}
        self.replays = 0
        # One memory pool for every captured graph, as vLLM keeps: graphs never run at once
        # and each writes its result into `hidden` (outside the pool), so one graph's
        # intermediates may reuse another's memory. Captured largest batch first, the pool
        # is as large as the largest forward needs instead of the sum over every graph.
        self.pool = None

    @staticmethod
    def supports(model) -> bool:
        """Routed experts pick their rows per token (data-dependent shapes): not captured."""
        return not any(isinstance(m, SparseMoE) for m in model.modules())

    def capture_all(self, lora: bool) -> float:
        """Make every bucket's forward now, without LoRA and (`lora`: the engine serves
        adapters) with it, instead of at a bucket's first decode step: on CUDA a capture's
        warm-up runs and the capture itself would stall every running stream mid-serving.
        The buffers hold padding rows meanwhile (no adapter, KV to the scratch slot, a context
        of one), so the warm-up runs write nothing a sequence reads. DoRA forwards stay made
        on first use (a DoRA adapter in the batch). Returns the seconds taken."""
        start = time.perf_counter()
        for b in reversed(self.buckets):  # largest first: the shared pool's size is set once
            for with_lora in (False, True) if lora else (False,):
                if (b, with_lora, False) not in self.graphs:
                    self.graphs[(b, with_lora, False)] = self._forward(b, with_lora)
        return time.perf_counter() - start

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _forward(self, b: int, lora: bool, dora: bool = False) -> Callable[[], None]:
        """The forward of bucket b over the buffers' first b rows."""
        model, planner = self.model, self.planner
        ids, pos = self.input_ids[:b], self.positions[:b]
        ctx = planner.static_context(
            self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b], self.row_slots[:b],
            lora=lora, dora=dora,
        )  # fmt: skip
        out = self.hidden[:b]

        def run() -> None:
            # RoPE rows inside the forward: a captured graph reads the positions buffer
            step = dataclasses.replace(ctx, rope=planner.rope(pos))
            out.copy_(model(ids, pos, step))

        if not self.capture:
            return run
        try:
            return self._capture(run, b, lora, dora)
        except RuntimeError as e:  # a graph that cannot be captured runs its buffers uncaptured
            log.warning("decode graph for batch %d not captured (%s): running it eagerly", b, e)
            return run

    def _capture(self, run: Callable[[], None], b: int, lora: bool, dora: bool):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (allocator, lazy kernels) outside the capture
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        self.pool = graph.pool()
        kind = "DoRA" if dora else ("LoRA" if lora else "no LoRA")
        log.debug("decode graph captured: batch %d, %s", b, kind)  # capture_all logs the sum
        return graph.replay

    def run(self, step: DecodeInputs) -> torch.Tensor:
        """hidden [n, hidden] of one decode step (n rows, row i one sequence's token)."""
        row_slots, tables = step.row_slots, step.block_tables
        n = len(step.input_ids)
        b = self.bucket(n)
        lora = any(s >= 0 for s in row_slots)
        dora_slots = getattr(self.model, "lora_dora_slots", ())  # per slot: uses DoRA
        dora = lora and any(dora_slots[s] for s in row_slots if s >= 0)
        dev = self.input_ids.device

        def fill(buf: torch.Tensor, values, pad) -> None:
            buf[:n].copy_(torch.tensor(values, dtype=torch.int64), non_blocking=True)
            buf[n:b].fill_(pad)

        fill(self.input_ids, step.input_ids, 0)
        fill(self.positions, step.positions, 0)
        fill(self.slot_mapping, step.slot_mapping, self.scratch)
        fill(self.seq_lens, step.seq_lens, 1)
        fill(self.row_slots, row_slots, -1)
        width = max(len(t) for t in tables)
        padded = torch.zeros(n, self.block_tables.shape[1], dtype=torch.int64)
        padded[:, :width] = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        self.block_tables[:n].copy_(padded.to(dev))
        self.block_tables[n:b].zero_()
        key = (b, lora, dora)
        if key not in self.graphs:
            self.graphs[key] = self._forward(b, lora, dora)
        self.graphs[key]()
        self.replays += 1
        return self.hidden[:n]
