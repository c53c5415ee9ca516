"""Engine configuration: one self-checking dataclass."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    enable_prefix_caching: bool = True
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # None: 4 x max_loras
    scheduling_policy: str = "fcfs"
    seed: int = 0
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
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be a power of two between 8 and 128")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_loras < 1:
            raise ValueError("max_loras (adapter slots) must be >= 1")
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
        if self.scheduling_policy not in ("fcfs",):
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}; use 'fcfs'")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
