"""The one switch between the Triton kernels and the torch reference.

Engine code calls ops only through this module. Each op keeps the reference's signature,
semantics and docstring (see `reference.py`); the backend is chosen per call from the tensors'
device and the mode:

    LORAPLEX_KERNELS=auto       (default) Triton on CUDA tensors, the CPU backend (`cpu.py`,
                                batched torch) elsewhere
    LORAPLEX_KERNELS=reference  the torch reference (the kernels' oracle) everywhere: slow,
                                written for clarity; for checking the fast paths
    LORAPLEX_KERNELS=triton     Triton everywhere (on CPU only under TRITON_INTERPRET=1)

`paged_attention` and `lora_apply` also take `memo`, the forward pass's dict in which a backend
keeps what it plans once per step (the reference ignores it).

Triton modules are imported on first use: `@triton.jit` decides at decoration time whether it
builds an interpreted or a compiled kernel, so importing them early would freeze that choice
before a test can set TRITON_INTERPRET.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType

import torch

from loraplex.kernels import cpu, reference

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


@functools.cache
def _triton(name: str) -> ModuleType:
    return importlib.import_module(f"loraplex.kernels.{name}")


set_mode(os.environ.get("LORAPLEX_KERNELS", "auto"))


def _switch(module: str, name: str, planned: bool = False) -> Callable:
    """`cpu.<name>`, `reference.<name>` or the Triton op of the same name in
    `kernels/<module>.py`, chosen per call from the mode and whether any tensor argument lives
    on a GPU. `planned`: the op takes the step's `memo` (not passed to the reference)."""
    ref = getattr(reference, name)

    @functools.wraps(ref)
    def op(*args, memo: dict | None = None, **kwargs):
        on_gpu = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if _mode == "triton" or (_mode == "auto" and on_gpu):
            backend = _triton(module)
        elif _mode == "reference":
            return ref(*args, **kwargs)
        else:
            backend = cpu
        if planned:
            kwargs["memo"] = memo
        return getattr(backend, name)(*args, **kwargs)

    return op


write_kv_cache = _switch("kv_cache", "write_kv_cache")
paged_attention = _switch("paged_attention", "paged_attention", planned=True)
lora_apply = _switch("sgmv", "lora_apply", planned=True)
int8_matmul = _switch("dequant_matmul", "int8_matmul")
int4_matmul = _switch("dequant_matmul", "int4_matmul")
grouped_mm = _switch("moe_triton", "grouped_mm")
