"""`MemoryReport`: what the resident base model, the adapter slots and the KV pool take, and
what fits in them: logged once at start, read by /metrics (no torch here: the server process
of process mode reads it too).

    device memory = base weights (after quantization; no KV cache, no adapters)
                  + budget = adapter slots (max_loras x max_lora_rank, every layer)
                             + KV pool (whole blocks) + unused remainder
    budget: kv_cache_bytes, or on a GPU what gpu_memory_utilization leaves after the weights
            and a step's working memory (`gpu_pool_bytes`)
    host memory   = up to max_cpu_loras adapters (LRU), each as its checkpoint's tensors
"""

from __future__ import annotations

from dataclasses import dataclass


def gpu_pool_bytes(total: int, free: int, in_use: int, utilization: float, working: int) -> int:
    """Bytes the KV pool may take on a GPU (`gpu_memory_utilization`): the engine's share of
    the device (utilization x total) less what it holds already (`in_use`: the weights and
    the adapter slots) and a step's working memory (`working`), and never more than is free
    now less that working memory (another process may hold part of the device)."""
    return max(0, min(int(utilization * total) - in_use, free) - working)


def step_working_bytes(hidden: int, qkv: int, intermediate: int, vocab: int, dtype_bytes: int,
                       max_tokens: int, max_seqs: int) -> int:  # fmt: skip
    """A generous bound on what one step allocates besides weights, slots and KV: the widest
    activations of max_tokens rows (q|k|v, gate|up twice, a few hidden-wide buffers) twice
    over, float32 logits of max_seqs rows twice (a copy for sampling), and 1 GiB for what is
    not sized by the batch (CUDA graph pools, cuBLAS workspace, Triton, fragmentation)."""
    activations = 2 * max_tokens * (qkv + 4 * intermediate + 4 * hidden) * dtype_bytes
    return activations + 2 * max_seqs * vocab * 4 + (1 << 30)


@dataclass(frozen=True)
class MemoryReport:
    budget_bytes: int  # slots + KV pool: kv_cache_bytes, or the share a GPU leaves them
    adapter_slot_bytes: int
    kv_cache_bytes: int
    num_kv_blocks: int
    weight_bytes: int = 0  # resident base-model weights
    quantization: str | None = None  # int8 | int4 | fp8 | gptq | awq (checkpoint) | None
    dtype: str = ""
    block_size: int = 0
    adapter_slots: int = 0  # max_loras: adapters on the device at once
    max_lora_rank: int = 0
    host_adapters: int = 0  # max_cpu_loras: adapters kept in host memory
    device: str = ""  # where the engine runs: "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)", ...

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def summary(self) -> str:
        """The start log's one line."""
        mib = 2**20
        return (
            (f"on {self.device}: " if self.device else "")
            + f"weights {self.weight_bytes / mib:.1f} MiB ({self.dtype}, quantization="
            f"{self.quantization or 'none'}); KV cache {self.kv_cache_tokens} tokens "
            f"({self.num_kv_blocks} blocks of {self.block_size}, "
            f"{self.kv_cache_bytes / mib:.1f} MiB); adapter slots {self.adapter_slots} of rank "
            f"<= {self.max_lora_rank} ({self.adapter_slot_bytes / mib:.1f} MiB) + "
            f"{self.host_adapters} in host memory; budget {self.budget_bytes / mib:.1f} MiB"
        )
