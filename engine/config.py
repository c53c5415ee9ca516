"""Engine configuration: one self-checking dataclass."""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger("loraplex.engine")


@functools.cache
def cpu_has_native_half(dtype: str) -> bool:
    """Whether this CPU multiplies `dtype` matrices in hardware (else a much slower emulation)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    wanted = {"bfloat16": {"avx512_bf16", "amx_bf16"}, "float16": {"avx512_fp16", "amx_fp16"}}
    return bool(flags & wanted.get(dtype, set()))


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # the dtype config.json declares
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Tokens one step may give the Batch API's class (engine/scheduler.py): a request that
    # arrives while a step runs waits for its end, so steps carrying batch work stay short.
    max_batch_step_tokens: int = 32
    enable_prefix_caching: bool = True
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # None: 4 x max_loras
    # On a mixture-of-experts base, give every adapter slot room for expert LoRA (slots x
    # experts x max_lora_rank x (hidden + 3 x expert width) per routed layer, out of the same
    # budget as the KV cache); False serves attention and router adapters only.
    expert_lora: bool = True
    scheduling_policy: str = "fcfs"  # or "vtc": weighted fair share across tenants
    # On a CPU without bf16/fp16 matmul instructions, compute in float32 (None: decide from
    # the CPU's flags). Twice the weight memory, several times the speed.
    cpu_float32_compute: bool | None = None
    # Weight-only quantization of the base model's linear layers: None | "int8" | "int4" |
    # "fp8" (from a float checkpoint; a GPTQ / AWQ / FP8 checkpoint is detected by itself).
    quantization: str | None = None
    # How the CPU path computes attention: "sdpa" (torch's fused kernel), "matmul" (batched
    # matmuls, float32 softmax) or "auto": time both on the model's shape at start, keep the
    # faster (which wins depends on the CPU, by a wide margin either way: docs/cpu-path.md).
    # LORAPLEX_CPU_ATTENTION sets the default (as it does the server's setting).
    cpu_attention: str = field(
        default_factory=lambda: os.environ.get("LORAPLEX_CPU_ATTENTION", "auto")
    )
    # Decode steps from persistent buffers, captured per batch bucket as CUDA graphs
    # (engine/graph_runner.py). None: graphs on CUDA, plain steps on the CPU; True: never;
    # False: always (on the CPU the same buffered forward runs uncaptured, as a check).
    enforce_eager: bool | None = None
    # Threads for torch's CPU ops (None: torch's default, one per core). A server should leave
    # a core to its HTTP loop: busy-waiting compute threads starve it (docs/benchmarks.md,
    # "Measurements behind choices in the code").
    num_threads: int | None = None
    seed: int = 0
    # KV cache element type: "auto" (the compute dtype) or "int8" (per-token-per-head float16
    # scales; about twice the tokens in the same kv_cache_bytes).
    kv_cache_dtype: str = "auto"
    # Admit a request only when its expected KV growth fits (output lengths learned from
    # finished requests, engine/admission.py) instead of by its prompt alone.
    kv_admission: bool = False
    # Speculative decoding by prompt lookup (n-gram): tokens proposed per request per step and
    # scored in the same forward pass (0: off). Pays where outputs repeat their context.
    num_speculative_tokens: int = 0
    # Host-memory KV pool for preemption by swap (engine/swap.py), in GiB as vLLM's
    # swap_space; num_host_kv_blocks sets it in blocks instead. 0: preempt by recompute only.
    swap_space_gib: float = 0.0
    num_host_kv_blocks: int | None = None
    # "auto": swap or recompute, whichever the measured costs say is cheaper for the victim;
    # "swap" / "recompute": always that (swap still falls back when the host pool is full).
    preemption_mode: str = "auto"
    hf_config: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        path = Path(self.model)
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {self.model!r} has no config.json")
        self.hf_config = json.loads((path / "config.json").read_text())
        if self.dtype == "auto":
            declared = self.hf_config.get("dtype") or self.hf_config.get("torch_dtype")
            self.dtype = declared if declared in _DTYPES else "float32"
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.cpu_float32_compute is None:
            self.cpu_float32_compute = (
                self.device == "cpu"
                and self.dtype != "float32"
                and not cpu_has_native_half(self.dtype)
            )
        if self.cpu_float32_compute and self.dtype != "float32":
            log.warning(
                "this CPU has no native %s matmul: computing in float32 "
                "(pass cpu_float32_compute=False to force %s)",
                self.dtype,
                self.dtype,
            )
        if self.cpu_attention not in ("auto", "sdpa", "matmul"):
            raise ValueError(
                f"cpu_attention must be 'auto', 'sdpa' or 'matmul', got {self.cpu_attention!r}"
            )
        if self.quantization not in (None, "int8", "int4", "fp8"):
            raise ValueError(
                f"quantization must be None, 'int8', 'int4' or 'fp8', got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or 'int8', got {self.kv_cache_dtype!r}"
            )
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be a power of two between 8 and 128")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1 (or None for torch's default)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_batch_step_tokens < 1:
            raise ValueError("max_batch_step_tokens must be >= 1")
        if self.max_loras < 1:
            raise ValueError("max_loras (adapter slots) must be >= 1")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be between 0 (off) and 16")
        if self.swap_space_gib < 0 or (self.num_host_kv_blocks or 0) < 0:
            raise ValueError("swap_space_gib and num_host_kv_blocks must be >= 0 (0: no swap)")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be 'auto', 'swap' or 'recompute', got "
                f"{self.preemption_mode!r}"
            )
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError("max_lora_rank must be between 1 and 512")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 4 * self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        model_max = int(self.hf_config.get("max_position_embeddings", 4096))
        if self.max_model_len is None:
            self.max_model_len = min(model_max, 8192)
        if self.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {model_max}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_model_len}); raise it or enable chunked prefill"
            )
        if self.scheduling_policy not in ("fcfs", "vtc"):
            raise ValueError(
                f"unknown scheduling_policy {self.scheduling_policy!r}; use 'fcfs' or 'vtc'"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype weights, activations and the KV cache are held in."""
        return torch.float32 if self.cpu_float32_compute else _DTYPES[self.dtype]
