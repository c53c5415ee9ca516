"""Engine configuration: one self-checking dataclass."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.engine.options import EngineOptions

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


def resolve_device(device: str) -> str:
    """The torch device an engine runs on: "auto" is the first GPU torch sees, else the CPU;
    any other name must be a device this torch can use (ValueError says what to pass)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            build = "a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise ValueError(
                f"device {device!r}: torch {torch.__version__} ({build}) sees no GPU here; "
                "pass device cpu or auto"
            )
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {device!r}: torch sees {count} GPU(s), cuda:0..{count - 1}")
    return device


@dataclass
class EngineConfig(EngineOptions):
    """The engine's options (engine/options.py, each defined there once) for one model."""

    hf_config: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        path = Path(self.model)
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {self.model!r} has no config.json")
        self.hf_config = json.loads((path / "config.json").read_text())
        if self.dtype == "auto":
            declared = self.hf_config.get("dtype") or self.hf_config.get("torch_dtype")
            self.dtype = declared if declared in _DTYPES else "float32"
        self.check_options()
        self.device = resolve_device(self.device)
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
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be a power of two between 8 and 128")
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

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype weights, activations and the KV cache are held in."""
        return torch.float32 if self.cpu_float32_compute else _DTYPES[self.dtype]
