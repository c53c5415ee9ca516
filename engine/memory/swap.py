"""Preemption by swap: a bounded host-memory KV pool, and measured costs that pick swap or
recompute for each victim.

A preempted request either drops its KV and later recomputes every computed token (a
prefill), or copies its blocks to host memory and back. Which is cheaper depends on the
machine, the model and the request, so both sides are measured, not assumed:

    swap_s(n)      = out_fixed + n x out_per_block + in_fixed + n x in_per_block
                     (timed at engine start on the real caches: device -> host -> device)
    recompute_s(t) = t computed tokens x seconds per token, the slope of the runner's own
                     recent step times over their token counts (least squares): what a
                     token adds to a step, as recomputed tokens ride in steps that run anyway
    swap           when swap_s(blocks held) < recompute_s(computed tokens) and the host pool
                   has the blocks; otherwise recompute, as without a host pool

The host pool mirrors the device caches block for block, in every layer, scales included
for an int8 cache (pinned on a GPU, so copies go by DMA):

    device  k_cache [num_blocks, bs, kv_heads, head_dim]   k_scale [num_blocks, bs, kv_heads]
    host    k_cache [num_host,   bs, kv_heads, head_dim]   k_scale [num_host,   bs, kv_heads]
            (v_cache, v_scale alike)                        row b = one whole block

Shared blocks (prefix-cache hits, forked samples): the victim copies every block it holds,
then drops its references as any preemption does, so other holders keep theirs. On swap-in,
leading blocks still in the prefix cache are shared again instead of copied; the rest come
back from host into fresh blocks.

The scheduler decides and books blocks (`SwapSpace`, no tensors); the engine makes the
copies (`HostKVCache`) after scheduling and before the model runs: swap-outs first (a block
a swap-out frees may be written by this very step), then swap-ins. Host blocks a swap-in
read are only returned to the pool at the next schedule, so no swap-out overwrites them
before they are read.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from loraplex.engine.memory.block_manager import BlockManager
from loraplex.engine.sequence import Sequence

KV_TENSORS = ("k_cache", "v_cache", "k_scale", "v_scale")


@dataclass
class SwapCosts:
    """Seconds: copies measured at start; prefill per token from the runner's steps."""

    out_fixed_s: float = 0.0
    out_per_block_s: float = 0.0
    in_fixed_s: float = 0.0
    in_per_block_s: float = 0.0
    steps: deque = field(default_factory=lambda: deque(maxlen=64), repr=False)  # (tokens, s)
    prefill_per_token_s: float | None = None  # None: too few steps of different sizes yet

    def swap_s(self, num_blocks: int) -> float:
        out = self.out_fixed_s + num_blocks * self.out_per_block_s
        return out + self.in_fixed_s + num_blocks * self.in_per_block_s

    def recompute_s(self, num_tokens: int) -> float | None:
        if self.prefill_per_token_s is None:
            return None
        return num_tokens * self.prefill_per_token_s

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        recompute = self.recompute_s(num_tokens)
        return recompute is not None and self.swap_s(num_blocks) < recompute

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """One runner step of `num_tokens` tokens took `seconds`: refit seconds per token.
        A fit that comes out flat or falling (a busy machine's spike) keeps the last one."""
        self.steps.append((num_tokens, seconds))
        n = len(self.steps)
        mean_t = sum(t for t, _ in self.steps) / n
        mean_s = sum(s for _, s in self.steps) / n
        var = sum((t - mean_t) ** 2 for t, _ in self.steps)
        if var > 0:
            slope = sum((t - mean_t) * (s - mean_s) for t, s in self.steps) / var
            if slope > 0:
                self.prefill_per_token_s = slope


class SwapSpace:
    """The host pool's bookkeeping and the swap-or-recompute decision (the scheduler's side)."""

    def __init__(self, block_manager: BlockManager, num_blocks: int, costs: SwapCosts,
                 mode: str = "auto"):  # fmt: skip
        assert num_blocks > 0 and mode in ("auto", "swap", "recompute")
        self.block_manager = block_manager
        self.num_blocks = num_blocks
        self.costs = costs
        self.mode = mode
        self.free_blocks: list[int] = list(range(num_blocks))
        self.tables: dict[int, list[int]] = {}  # seq_no -> host blocks of a swapped-out seq
        self._read: list[int] = []  # host blocks read by this step's swap-ins
        self.num_swapped_out = 0  # preemptions by swap
        self.num_swapped_in = 0
        self.num_recomputed = 0  # preemptions by recompute
        self.blocks_out = 0
        self.blocks_in = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self._read)

    def is_swapped(self, seq: Sequence) -> bool:
        return seq.seq_no in self.tables

    def begin_step(self) -> None:
        """The last step's swap-ins are done: their host blocks may be reused."""
        self.free_blocks += self._read
        self._read = []

    def should_swap(self, seq: Sequence) -> bool:
        num_blocks = self.block_manager.blocks_needed(seq.num_computed_tokens)
        if not num_blocks or num_blocks > len(self.free_blocks) or self.mode == "recompute":
            return False
        return self.mode == "swap" or self.costs.prefers_swap(num_blocks, seq.num_computed_tokens)

    def swap_out(self, seq: Sequence, copies: list[tuple[int, int]]) -> bool:
        """Preempt `seq` by swap if that is cheaper and fits: book host blocks, add the
        (device, host) copies to `copies`, free its device blocks and keep its progress.
        Returns False, changing nothing, for a preemption by recompute."""
        if not self.should_swap(seq):
            self.num_recomputed += 1
            return False
        n = self.block_manager.blocks_needed(seq.num_computed_tokens)
        host = [self.free_blocks.pop() for _ in range(n)]
        copies += zip(seq.block_table[:n], host, strict=True)  # blocks past them: unwritten
        self.tables[seq.seq_no] = host
        self.block_manager.free(seq)
        self.num_swapped_out += 1
        self.blocks_out += n
        return True

    def swap_in(self, seq: Sequence, num_shared: int, copies: list[tuple[int, int]]) -> None:
        """`seq` was given device blocks again, its first `num_shared` from the prefix cache:
        add the (host, device) copies of the others to `copies`."""
        host = self.tables.pop(seq.seq_no)
        copies += [(host[i], seq.block_table[i]) for i in range(num_shared, len(host))]
        self._read += host
        self.num_swapped_in += 1
        self.blocks_in += max(0, len(host) - num_shared)

    def free(self, seq: Sequence) -> None:
        """`seq` finished or was aborted: return any host blocks it holds."""
        self.free_blocks += self.tables.pop(seq.seq_no, [])

    def check_all_free(self) -> None:
        assert not self.tables, f"sequences still swapped out: {list(self.tables)[:10]}"
        assert sorted(self.free_blocks + self._read) == list(range(self.num_blocks))


class HostKVCache:
    """Host-memory copies of KV blocks, shaped as the device caches (the engine's side)."""

    def __init__(self, attentions: list, num_blocks: int, device: torch.device):
        self.attentions = attentions
        self.device = device
        pin = device.type == "cuda"
        self.layers: list[dict[str, torch.Tensor]] = []
        for attn in attentions:
            tensors = {}
            for name in KV_TENSORS:
                t = getattr(attn, name, None)
                if t is not None:  # [num_host_blocks, *one block's shape]
                    shape = (num_blocks, *t.shape[1:])
                    tensors[name] = torch.zeros(shape, dtype=t.dtype, pin_memory=pin)
            self.layers.append(tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer.values())

    @torch.inference_mode()
    def swap_out(self, copies: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: (device, host) pairs."""
        if not copies:
            return
        src = torch.tensor([d for d, _ in copies], device=self.device)
        dst = torch.tensor([h for _, h in copies])
        for attn, host in zip(self.attentions, self.layers, strict=True):
            for name, h in host.items():
                h[dst] = getattr(attn, name)[src].to("cpu")

    @torch.inference_mode()
    def swap_in(self, copies: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: (host, device) pairs."""
        if not copies:
            return
        src = torch.tensor([h for h, _ in copies])
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for attn, host in zip(self.attentions, self.layers, strict=True):
            for name, h in host.items():
                getattr(attn, name)[dst] = h[src].to(self.device)

    def _time(self, fn, copies, repeats: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            fn(copies)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - t0)
        return best

    def measure(self, num_device_blocks: int, max_blocks: int = 16, repeats: int = 5) -> SwapCosts:
        """Time copies of 1 and of k blocks each way; fit fixed + per-block seconds.

        Runs before any request: the device blocks it round-trips hold nothing yet."""
        host_blocks = len(next(iter(self.layers[0].values())))
        k = min(max_blocks, host_blocks, num_device_blocks)
        costs = SwapCosts()
        for way, fn in (("out", self.swap_out), ("in", self.swap_in)):
            one = self._time(fn, [(0, 0)], repeats)
            many = self._time(fn, [(i, i) for i in range(k)], repeats) if k > 1 else one
            per_block = max(0.0, (many - one) / (k - 1)) if k > 1 else one
            setattr(costs, f"{way}_fixed_s", max(0.0, one - per_block))
            setattr(costs, f"{way}_per_block_s", per_block)
        return costs


def num_host_blocks(config, device_block_bytes: int) -> int:
    """The host pool's size in blocks: num_host_kv_blocks, else swap_space_gib's worth."""
    if config.num_host_kv_blocks is not None:
        return config.num_host_kv_blocks
    return int(config.swap_space_gib * 2**30) // device_block_bytes
