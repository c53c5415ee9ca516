"""The one switch between the Triton kernels and the torch reference.

Engine code calls ops only through this module. Each op keeps the reference's signature and
semantics (see `reference.py`); the backend is chosen per call from the tensors' device and
the mode:

    LORAPLEX_KERNELS=auto       (default) Triton on CUDA tensors, the reference elsewhere
    LORAPLEX_KERNELS=reference  the torch reference everywhere
    LORAPLEX_KERNELS=triton     Triton everywhere (on CPU only under TRITON_INTERPRET=1)

Triton modules are imported on first use: `@triton.jit` decides at decoration time whether it
builds an interpreted or a compiled kernel, so importing them early would freeze that choice
before a test can set TRITON_INTERPRET.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from loraplex.kernels import reference

MODES = ("auto", "reference", "triton")
_mode = "auto"


def set_mode(mode: str) -> None:
    """Select the backend for every later call (auto | reference | triton)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"LORAPLEX_KERNELS must be one of {', '.join(MODES)}, not {mode!r}")
    _mode = mode


def get_mode() -> str:
    return _mode


def use_triton(t: torch.Tensor) -> bool:
    return _mode == "triton" or (_mode == "auto" and t.is_cuda)


def _triton(name: str) -> ModuleType:
    return importlib.import_module(f"loraplex.kernels.{name}")


set_mode(os.environ.get("LORAPLEX_KERNELS", "auto"))


def write_kv_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See reference.write_kv_cache."""
    impl = _triton("kv_cache") if use_triton(k) else reference
    impl.write_kv_cache(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """See reference.paged_attention."""
    impl = _triton("paged_attention") if use_triton(q) else reference
    impl.paged_attention(
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
        sliding_window, softcap,
    )  # fmt: skip


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    widths: Sequence[int],
) -> None:
    """See reference.lora_apply."""
    impl = _triton("sgmv") if use_triton(x) else reference
    impl.lora_apply(y, x, lora_a, lora_b, segments, widths)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """See reference.int8_matmul."""
    impl = _triton("dequant_matmul") if use_triton(x) else reference
    return impl.int8_matmul(x, qweight, scales)


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int = 128,
) -> torch.Tensor:
    """See reference.int4_matmul."""
    impl = _triton("dequant_matmul") if use_triton(x) else reference
    return impl.int4_matmul(x, qweight, scales, zeros, group_size)
